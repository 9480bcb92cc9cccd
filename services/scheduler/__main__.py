from services.scheduler.config import SchedulerConfig
from services.scheduler.service import serve
from shared.runtime import service_main

if __name__ == "__main__":
    service_main("scheduler", SchedulerConfig, serve)
