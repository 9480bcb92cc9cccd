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

``PDL`` off: the kernels compile without these instructions and launch as before. Under
TRITON_INTERPRET=1 the instructions do not exist; tests of the on path swap them for no-ops
(tests/kernels/test_pdl.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# issue 15: off until measured on the H200 (BENCHMARKS.md, issue 15, "Programmatic dependent
# launch"); read at each launch, so a CUDA graph keeps what was read at its capture. TUNE
PDL = False


def launch_options() -> dict:
    """Launch keywords of a kernel taking ``PDL: tl.constexpr``: the switch as that constexpr
    and as Triton's launch option (both or neither: a PDL launch must wait)."""
    return {"PDL": PDL, "launch_pdl": PDL}


@triton.jit
def wait_then_launch_dependents(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has completed and its writes are
    visible, then let the next kernel's programs launch. Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
