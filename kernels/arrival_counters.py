"""Zeroed int32 counters for "the last program to arrive finishes the job" kernels.

A kernel whose programs each write a partial result (split-K GEMM tiles, split-KV attention
segments) can merge them itself instead of in a second launch: every program adds 1 to its
group's counter after its partial is stored, and the one that sees ``group size - 1`` reads the
partials back in a fixed order (deterministic: the same sums in the same order as a separate
reduce) and resets the counter to 0. So the counters are zero between launches, and one buffer
per device serves every such kernel: launches on one stream run one after another.

The buffer only grows, and an outgrown buffer is kept alive: a CUDA graph captured with it
still points at it.
"""

from __future__ import annotations

import torch
import triton

_buffers: dict[torch.device, list[torch.Tensor]] = {}  # device -> every buffer made, newest last
MIN_NUMEL = 4096


def arrival_counters(device: torch.device, numel: int) -> torch.Tensor:
    """At least ``numel`` zeroed int32 counters on ``device`` (kernels leave them zeroed)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffers = _buffers.setdefault(device, [])
    if not buffers or buffers[-1].numel() < numel:
        buffers.append(torch.zeros(max(MIN_NUMEL, triton.next_power_of_2(numel)),
                                   dtype=torch.int32, device=device))
    return buffers[-1]
