"""A one-shot all-reduce over GPU peer memory for tensor parallelism's small sums.

A decode step's all-reduces are a few KB to a few MB (tokens x hidden size), where NCCL's
latency, not bandwidth, sets their cost, and a Llama-3.1-8B step runs 64 of them. Here every
rank copies its part into a buffer the other ranks can read over NVLink (PyTorch's symmetric
memory), waits at a barrier, and sums every rank's part itself: one kernel, no ring. Larger
sums (prompt steps) stay with NCCL, which moves bytes better.

Every rank sums the parts in rank order, so every rank gets the same bits (as NCCL's do).
The barrier lives in the symmetric memory's signal pads and resets itself, so the kernel is
safe inside CUDA graphs.

o_proj and down, whose sums the decoder adds to the residual and normalizes at once, take
``all_reduce_add_rms_norm`` instead: this rank's split-K reduce, the sum over the ranks, the
add and the norm in one kernel (kernels/all_reduce_rms_norm.py) over a second symmetric
buffer, in place of three launches.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from kernels import all_reduce_rms_norm
from kernels.rms_norm import MAX_SINGLE_PASS

log = structlog.get_logger()

# Sums up to this many bytes take the one-shot path: decode steps of up to 256 requests of
# hidden size 4096 in bf16 (2 MiB), where it beat NCCL on 2 x H200 (docs/tensor-parallel.md)
ONE_SHOT_MAX_BYTES = 2 << 20
_ALIGNMENT = 16  # bytes: the kernel's vector loads
_formed_in_this_process = False  # symmetric memory's rendezvous counts per process


class OneShotReduce:
    """``group``'s ranks summing tensors of up to ``max_bytes`` through one symmetric
    buffer (allocated once, on this rank's current CUDA device)."""

    def __init__(self, group: torch.distributed.ProcessGroup, device: torch.device,
                 max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)  # [max_bytes]
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.rank, world_size = group.rank(), group.size()
        # the fused kernel's slots and flags: zeroed before any rank can write a flag here
        self.norm_buffer = symm_mem.empty(all_reduce_rms_norm.buffer_bytes(world_size, max_bytes),
                                          dtype=torch.uint8, device=device)
        self.norm_buffer.zero_()
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(self.norm_buffer, self.group_name)
        self.buffer_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64,
                                        device=device)  # [world_size]
        self.call_counts = torch.zeros(all_reduce_rms_norm.FLAG_ROWS, dtype=torch.int64,
                                       device=device)  # [FLAG_ROWS]: this rank's alone

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.is_contiguous() and nbytes <= self.max_bytes
                and nbytes % _ALIGNMENT == 0 and x.dtype in (torch.bfloat16, torch.float16,
                                                            torch.float32))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (``takes(x)`` must hold)."""
        nbytes = x.numel() * x.element_size()
        symmetric = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(symmetric, x, "sum",
                                                               self.group_name, x)

    def takes_add_rms_norm(self, residual: torch.Tensor) -> bool:
        """Whether ``all_reduce_add_rms_norm`` takes a sum into this residual [M, N]."""
        num_rows, hidden_size = residual.shape
        return (residual.is_cuda and residual.stride(1) == 1 and hidden_size <= MAX_SINGLE_PASS
                and residual.dtype in (torch.bfloat16, torch.float16)
                and num_rows <= all_reduce_rms_norm.max_rows(hidden_size, residual.dtype,
                                                             self.max_bytes))

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, bias: torch.Tensor | None,
                                residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(sum + residual), sum + residual) of the ranks' projection outputs, the sum
        added into residual; partial: this rank's, [split_k, M, N] fp32 partials (``bias`` to
        add) or [M, N] rounded (bias in, ``bias`` None)."""
        return all_reduce_rms_norm.all_reduce_add_rms_norm(
            partial, bias, residual, norm_weight, eps, self.buffer_ptrs, self.call_counts,
            self.rank, self.max_bytes)


def one_shot_reduce(group: torch.distributed.ProcessGroup, device: torch.device,
                    agree_min: Callable[[int], int]) -> OneShotReduce | None:
    """The group's one-shot all-reduce, or None where this PyTorch or machine has none (NCCL
    then sums everything). Every rank calls this together; ``agree_min`` is the group's
    minimum of an int, so all ranks take the path or none does.

    Once per process: a process that formed a group before (tests do) numbers its symmetric
    allocations on from there while a new rank starts at zero, and their rendezvous would
    wait for each other forever; then the whole group stays with NCCL."""
    global _formed_in_this_process
    if not agree_min(int(not _formed_in_this_process)):
        log.info("one_shot_all_reduce_skipped", reason="a rank formed one in its process before")
        return None
    _formed_in_this_process = True
    try:
        one_shot = OneShotReduce(group, device)
    except (RuntimeError, AttributeError, NotImplementedError) as error:
        log.warning("one_shot_all_reduce_unavailable", error=str(error))
        one_shot = None
    return one_shot if agree_min(int(one_shot is not None)) else None
