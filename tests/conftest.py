import os

from shared.reproducible_cpu import require_reproducible_blas

require_reproducible_blas()  # before torch loads (MKL reads it once): bit-reproducible CPU math

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
