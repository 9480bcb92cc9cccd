"""Bit-reproducible CPU math: Intel MKL's conditional numerical reproducibility (CNR) mode.

Why: torch's CPU BLAS is MKL, and with CNR off (MKL's default) the code path a GEMM takes may
depend on the thread that runs it. On an AMD EPYC (Zen 4) two-core machine, SDPA's CPU flash
kernel gave a different last bit for a (sequence, head) computed on the OpenMP worker thread
than for the same one computed on the main thread; which thread computes it depends on the
batch, so a sequence's attention (and in the end its greedy tokens) depended on which other
sequences shared its step. On Intel CPUs both threads took the same path, which hid it.

``MKL_CBWR=AUTO`` keeps MKL's own choice of instruction set but fixes its reductions and
scheduling, so a row's result no longer depends on its thread or batch. MKL reads the variable
once, when torch loads it: call ``require_reproducible_blas()`` before the first ``import torch``
of a process (the worker's entry point, the tests' conftest). A value already set is kept, so an
operator can still choose another CNR branch (e.g. ``MKL_CBWR=AVX512``).
"""

from __future__ import annotations

import os
import sys
import warnings

MKL_CBWR_ENV = "MKL_CBWR"
MKL_CBWR_DEFAULT = "AUTO"


def require_reproducible_blas() -> bool:
    """Set MKL's CNR mode for this process (and the processes it starts). False, with a
    warning, when torch is loaded already: MKL has read its setting, so this process's CPU
    results may depend on their thread (a pytest plugin that imports torch, say)."""
    if MKL_CBWR_ENV in os.environ:
        return True
    os.environ[MKL_CBWR_ENV] = MKL_CBWR_DEFAULT
    if "torch" in sys.modules:
        warnings.warn(f"{MKL_CBWR_ENV} was set after torch was imported: this process's CPU "
                      "math may not be bit-reproducible across threads", stacklevel=2)
        return False
    return True
