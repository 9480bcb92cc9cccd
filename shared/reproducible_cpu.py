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

MKL_CBWR_ENV = "MKL_CBWR"
MKL_CBWR_DEFAULT = "AUTO"


def require_reproducible_blas() -> None:
    """Set MKL's CNR mode for this process; an error if torch is loaded already (too late)."""
    if MKL_CBWR_ENV in os.environ:
        return
    if "torch" in sys.modules:
        raise RuntimeError(f"{MKL_CBWR_ENV} must be set before torch is imported: call "
                           "require_reproducible_blas() at the top of the entry point")
    os.environ[MKL_CBWR_ENV] = MKL_CBWR_DEFAULT
