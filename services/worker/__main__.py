from shared.reproducible_cpu import require_reproducible_blas

require_reproducible_blas()  # before torch loads: MKL reads it once

from services.worker.config import WorkerConfig  # noqa: E402
from services.worker.service import run  # noqa: E402
from shared.runtime import setup_process  # noqa: E402

if __name__ == "__main__":
    run(setup_process("worker", WorkerConfig))
