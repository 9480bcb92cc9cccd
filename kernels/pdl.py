"""Programmatic dependent launch (PDL) of the decode kernels (Hopper and later).

A batch-1 decode step is one CUDA graph of ~360 short kernels; between two of them the GPU
drains one grid and ramps up the next. Launched with PDL, a kernel's programs may start while
the kernel before it in the stream still runs: they do their index math (the skinny GEMM also
loads its first weight tile, since no kernel writes weights), then wait in
``wait_then_launch_dependents`` until that kernel has completed and its writes are visible.

Rules for a kernel that takes ``PDL: tl.constexpr`` (launched with ``**launch_options()``):

- every program calls ``wait_then_launch_dependents(PDL)`` unconditionally, before any branch
  that may return, before the first load of anything a kernel may write (activations, the
  residual, the KV cache, scratch, the step's metadata) and before its first store (the memory
  it writes may be a buffer the previous kernel still reads: allocators hand freed memory on).
- a kernel completes only after its own wait, so one wait covers every kernel before it, PDL
  or not. A kernel launched with PDL that never waits would break that chain for all later
  ones: a kernel not converted must not be launched with PDL.
- the next kernel may launch only once this one has passed its wait (the trigger follows the
  wait), so at most one kernel ahead holds SM slots while waiting.

PDL is on wherever the GPU has it (compute capability 9.0, Hopper, and later): on one H200 it
took batch-1 decode of Llama-3.1-8B from 4.62 to 4.48 and 4.47 ms/token in two alternating
pairs (graph replay 4.56 -> 4.41 ms). Off elsewhere (older GPUs, the CPU, Triton's
interpreter, which lacks the instructions; tests of the on path swap them for no-ops,
tests/kernels/test_pdl.py): the kernels then compile without them and launch as before.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MIN_CAPABILITY = (9, 0)  # griddepcontrol: Hopper and later
# None: on where the device supports it. True/False force it (tests and the decode benchmark's
# --pdl); read at each launch, so a CUDA graph keeps what was read at its capture.
PDL: bool | None = None


@functools.cache
def device_supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


def enabled() -> bool:
    """Whether this launch uses PDL: the override, else the current CUDA device's support."""
    if PDL is not None:
        return PDL
    return torch.cuda.is_available() and device_supports_pdl(torch.cuda.current_device())


def launch_options() -> dict:
    """Launch keywords of a kernel taking ``PDL: tl.constexpr``: PDL as that constexpr and as
    Triton's launch option (both or neither: a PDL launch must wait)."""
    on = enabled()
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_then_launch_dependents(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has completed and its writes are
    visible, then let the next kernel's programs launch. Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
