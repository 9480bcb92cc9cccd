"""Step inputs packed for one copy: each array lands whole, and each starts on 16 bytes
(Triton compiles a kernel anew for a pointer off that alignment)."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.staging import ALIGN_BYTES, aligned_starts, pack
from services.worker.step_inputs import to_device


def test_each_array_starts_on_sixteen_bytes():
    assert aligned_starts([3, 1, 2, 0, 5], 8) == ([0, 4, 6, 8, 8], 14)  # int64: 2 a line
    assert aligned_starts([3, 1, 5], 4) == ([0, 4, 8], 16)  # int32: 4 a line
    assert aligned_starts([], 8) == ([], 0)


def test_packed_arrays_come_back_whole_and_aligned():
    rng = np.random.default_rng(0)
    for dtype in (np.int64, np.int32):
        arrays = [rng.integers(0, 1 << 30, size) for size in (7, 1, 0, 12, 3)]
        out = np.full(aligned_starts([len(a) for a in arrays], np.dtype(dtype).itemsize)[1],
                      -1, dtype)
        for array, (start, size) in zip(arrays, pack(arrays, out)):
            assert start * out.itemsize % ALIGN_BYTES == 0 and size == len(array)
            assert np.array_equal(out[start:start + size], array)
        tensors = to_device(arrays, dtype, torch.device("cpu"))  # the path without staging
        for array, tensor in zip(arrays, tensors):
            assert tensor.data_ptr() % ALIGN_BYTES == 0 or tensor.numel() == 0
            assert np.array_equal(tensor.numpy(), array.astype(dtype))
