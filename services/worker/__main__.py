from services.worker.config import WorkerConfig
from services.worker.service import serve
from shared.runtime import service_main

if __name__ == "__main__":
    service_main("worker", WorkerConfig, serve)
