import os

from shared.reproducible_cpu import require_reproducible_blas

require_reproducible_blas()  # before torch loads (MKL reads it once): bit-reproducible CPU math
# OpenMP threads that wait for work sleep instead of spinning (libgomp reads it once, at load),
# here and in every process the tests start. The suite runs several CPU-bound processes on two
# cores (pytest, a stack's worker, gateway, scheduler; CI beside other work): a spinning waiter
# holds a core that the thread it waits for needs. A 64-prompt engine run on the 2-core machine
# under load took 107-130 s spinning, 16 s sleeping (same bits: only the wait changes).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import interpreter_dot

    interpreter_dot.install()  # a row's dot the same bits wherever it sits in its tile
