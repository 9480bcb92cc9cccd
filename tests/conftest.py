import os

from shared.reproducible_cpu import require_reproducible_blas

require_reproducible_blas()  # before torch loads (MKL reads it once): bit-reproducible CPU math

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import interpreter_dot

    interpreter_dot.install()  # a row's dot the same bits wherever it sits in its tile
