"""Step inputs through the pinned staging ring: what arrives on the GPU is what was
written, however many steps reuse the buffers and however large a step grows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.staging import HostStaging

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("behind_step", [False, True])  # the consuming stream, the side one
def test_copies_arrive_intact_through_reused_and_grown_buffers(behind_step):
    device = torch.device("cuda")
    staging = HostStaging(device, num_buffers=3, initial_nbytes=64)
    staging.behind_step = behind_step
    rng = np.random.default_rng(0)
    sent, received = [], []
    for step in range(40):
        size = int(rng.integers(1, 5_000)) if step % 7 else 200_000  # now and then a big step
        arrays = [rng.integers(0, 1 << 30, size, dtype=np.int64),
                  rng.integers(0, 1 << 30, size // 3 + 1, dtype=np.int32)]
        dtype = np.int64 if step % 2 else np.int32
        on_device = staging.to_device(arrays, dtype)
        # keep the GPU busy so later writes race the earlier copies if the ring did not wait
        torch.cuda._sleep(1_000_000)
        sent.append([a.astype(dtype) for a in arrays])
        received.append([t.clone() for t in on_device])
    torch.cuda.synchronize()
    for arrays, tensors in zip(sent, received):
        for array, tensor in zip(arrays, tensors):
            assert tensor.is_cuda and np.array_equal(tensor.cpu().numpy(), array)
            assert tensor.data_ptr() % 16 == 0  # (a kernel's pointer: one Triton variant)
