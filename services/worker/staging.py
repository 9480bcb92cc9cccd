"""Pinned host buffers that step inputs are written into and copied to the GPU from.

A step's inputs go to the device in a few host-to-device copies from pinned memory (a copy
from pageable memory waits for every kernel queued before it). Pinning a fresh buffer per
copy (``Tensor.pin_memory``) cost ~1 ms a step at 1,000 sequences (the caching host
allocator's bookkeeping plus an extra copy); these buffers are allocated once, grown when a
step needs more, and taken in turn. A buffer is written again only after the copy that read
it has finished (its event), which with several buffers in the ring has long happened.

While a step is in flight (``behind_step``, set by the runner) the copies run on a stream of
their own: they depend on nothing the GPU computes, so the consuming stream waits only for its
own copy (an event). Queued on the consuming stream, each copy waited behind the step in
flight and started a few microseconds after it ended (one H200, batch-1 decode: three copies
cost ~13 us between two steps' graphs); on their own stream they land while it still runs.
With nothing in flight (a step that waited for the one before: speculative verify steps) the
GPU is idle and the side stream's event wait only adds latency: verify steps at batch 1 took
~0.2 ms longer that way (replayed drafts at a synthetic acceptance of 3 tokens, H200: 1.93 ms
a token against 1.87 on the consuming stream), so those copies stay on the consuming stream.
"""

from __future__ import annotations

import numpy as np
import torch


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}
# Triton compiles a kernel again for a pointer argument off 16-byte alignment: a step's
# inputs, views of one copied tensor, each start on it. Packed end to end, a view after an
# odd number of int64s was off it, and the first eager step (a prompt chunk past the
# piecewise graphs) of such a layout compiled the KV-write kernel anew: one H200, a 340 ms
# stall 0.4 s into a Poisson run on a fresh machine.
ALIGN_BYTES = 16


def aligned_starts(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of arrays of ``sizes`` laid one after another in one buffer, each
    starting on ALIGN_BYTES, and the buffer's length in elements."""
    step = max(1, ALIGN_BYTES // itemsize)
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += -(-size // step) * step
    return starts, end


def pack(arrays: list[np.ndarray], out: np.ndarray) -> list[tuple[int, int]]:
    """Write ``arrays`` into ``out`` at aligned offsets -> each one's (start, length)."""
    sizes = [len(a) for a in arrays]
    starts, _ = aligned_starts(sizes, out.itemsize)
    for array, start in zip(arrays, starts):
        np.copyto(out[start:start + len(array)], array, casting="same_kind")
    return list(zip(starts, sizes))


class HostStaging:
    def __init__(self, device: torch.device, num_buffers: int = 8,
                 initial_nbytes: int = 1 << 20) -> None:
        self.device = device
        self._buffers = [torch.empty(initial_nbytes, dtype=torch.uint8, pin_memory=True)
                         for _ in range(num_buffers)]
        self._copied: list[torch.cuda.Event | None] = [None] * num_buffers
        self._turn = 0
        self._copy_stream = torch.cuda.Stream(device)
        self.behind_step = False  # a step is in flight: copy on the side stream
        # the other way: a step's sampled tokens go to the host on a stream of their own
        # (step_state.StepInFlight.start)
        self.read_back = torch.cuda.Stream(device)

    def to_device(self, arrays: list[np.ndarray], dtype: type) -> list[torch.Tensor]:
        """``arrays`` as views of one ``dtype`` tensor on the device (each 16-byte aligned),
        queued as one copy."""
        _, length = aligned_starts([len(a) for a in arrays], np.dtype(dtype).itemsize)
        nbytes = length * np.dtype(dtype).itemsize
        index, self._turn = self._turn, (self._turn + 1) % len(self._buffers)
        copied = self._copied[index]
        if copied is not None:
            copied.synchronize()  # the copy that last read this buffer
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(max(nbytes, 2 * self._buffers[index].numel()),
                                               dtype=torch.uint8, pin_memory=True)
        host = self._buffers[index][:nbytes].view(_TORCH_DTYPES[dtype])  # [length], pinned
        views = pack(arrays, host.numpy())
        copied = torch.cuda.Event()
        if self.behind_step:
            consumer = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._copy_stream):
                on_device = host.to(self.device, non_blocking=True)
                copied.record()
            consumer.wait_event(copied)
            on_device.record_stream(consumer)  # freed memory waits for the consumer's use
        else:
            on_device = host.to(self.device, non_blocking=True)
            copied.record()
        self._copied[index] = copied
        return [on_device[start:start + size] for start, size in views]


def to_host(values: torch.Tensor, read_back: torch.cuda.Stream | None = None
            ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``values`` (CUDA) to pinned host memory once the current stream's work
    so far is done, on ``read_back`` (None: the current stream) -> (the host tensor, the
    event of the copy; None on a CPU, where ``values`` is returned as it is). On a stream of
    its own the copy leaves the compute stream free to go on."""
    if not values.is_cuda:
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    compute = torch.cuda.current_stream(values.device)
    read_back = read_back or compute
    read_back.wait_stream(compute)  # what computes ``values`` is done
    with torch.cuda.stream(read_back):
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    values.record_stream(read_back)  # its memory waits for the copy too
    return host, copied
