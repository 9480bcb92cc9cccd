"""all_reduce_add_rms_norm (Triton): two ranks' parts summed through each other's buffers,
the residual added and the row normalized, against rms_norm_ref of the summed parts.

On CPU under TRITON_INTERPRET=1 both ranks live in this process: their "peer memory" is two
host buffers whose addresses the kernel gets, as it gets GPU peer addresses on a device. The
interpreter runs one kernel at a time, so rank 1's part reaches rank 0 from the test (written
where rank 1's kernel writes it): rank 0, in a thread, must wait for it; rank 1 then runs and
finds rank 0's part. On two GPUs: tests/services/worker/test_one_shot_reduce_gpu.py."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels.all_reduce_rms_norm import FLAG_ROWS, all_reduce_add_rms_norm, buffer_bytes, max_rows
from kernels.rms_norm import rms_norm_ref

WORLD, HIDDEN, PART_BYTES = 2, 64, 2048
DTYPE = torch.float16  # the interpreter's fp16 is exact numpy; bf16 rounds the same way


def shared_buffers():
    """Two zeroed rank buffers and the table of their addresses."""
    buffers = [torch.zeros(buffer_bytes(WORLD, PART_BYTES) // 8, dtype=torch.int64)
               for _ in range(WORLD)]
    return buffers, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


def publish(buffers, call, src, dst, part):
    """What rank ``src``'s kernel does for ``dst`` in call ``call``: the part, then the flag."""
    num_rows = part.shape[0]
    slots = buffers[dst].view(torch.uint8)[:2 * WORLD * PART_BYTES].view(DTYPE)
    slots.view(2, WORLD, max_rows(HIDDEN, DTYPE, PART_BYTES), HIDDEN)[call % 2, src,
                                                                      :num_rows] = part
    flags = buffers[dst][2 * WORLD * PART_BYTES // 8:].view(FLAG_ROWS, WORLD)
    flags[:num_rows, src] = call


def expected(parts_rounded, residual, norm_weight):
    summed = sum(p.float() for p in parts_rounded).to(DTYPE)  # rank order
    return rms_norm_ref(summed, norm_weight, 1e-5, residual.clone())


def run_rank(rank, partial, bias, residual, norm_weight, ptrs, counts):
    return all_reduce_add_rms_norm(partial, bias, residual, norm_weight, 1e-5, ptrs,
                                   counts[rank], rank, PART_BYTES)


@pytest.mark.parametrize("num_rows", [1, 3])
def test_two_ranks_get_the_same_bits_as_the_unfused_ops_call_after_call(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    buffers, ptrs = shared_buffers()
    counts = [torch.zeros(FLAG_ROWS, dtype=torch.int64) for _ in range(WORLD)]
    norm_weight = (1 + 0.5 * torch.randn(HIDDEN, generator=gen)).to(DTYPE)
    bias = torch.randn(HIDDEN, generator=gen).to(DTYPE)  # o_proj's and down's: rank 0 only
    for call in (1, 2, 3):  # both slot parities, and back
        splits = [torch.randn(2, num_rows, HIDDEN, generator=gen) for _ in range(WORLD)]
        rounded = [(s.sum(0) + (bias.float() if rank == 0 else 0.0)).to(DTYPE)
                   for rank, s in enumerate(splits)]
        residual = torch.randn(num_rows, HIDDEN, generator=gen).to(DTYPE)
        results = {}
        rank0 = threading.Thread(target=lambda: results.update({0: run_rank(
            0, splits[0], bias, residual.clone(), norm_weight, ptrs, counts)}))
        rank0.start()
        rank0.join(timeout=1.0)
        assert rank0.is_alive(), "rank 0 went on before rank 1 published its part"
        publish(buffers, call, 1, 0, rounded[1])
        rank0.join(timeout=60)
        assert not rank0.is_alive()
        results[1] = run_rank(1, rounded[1], None, residual.clone(), norm_weight, ptrs, counts)
        expected_out, expected_residual = expected(rounded, residual, norm_weight)
        for rank in range(WORLD):
            out, summed = results[rank]
            assert torch.equal(summed, expected_residual)
            assert torch.equal(out, expected_out)
        assert [int(c[0]) for c in counts] == [call, call]


def test_rows_beyond_a_slot_are_refused():
    _, ptrs = shared_buffers()
    rows = max_rows(HIDDEN, DTYPE, PART_BYTES)
    assert rows == PART_BYTES // (HIDDEN * 2)
    with pytest.raises(ValueError, match="rows"):
        all_reduce_add_rms_norm(torch.zeros(rows + 1, HIDDEN, dtype=DTYPE), None,
                                torch.zeros(rows + 1, HIDDEN, dtype=DTYPE),
                                torch.ones(HIDDEN, dtype=DTYPE), 1e-5, ptrs,
                                torch.zeros(FLAG_ROWS, dtype=torch.int64), 0, PART_BYTES)
