from services.worker.config import WorkerConfig
from services.worker.service import run
from shared.runtime import setup_process

if __name__ == "__main__":
    run(setup_process("worker", WorkerConfig))
