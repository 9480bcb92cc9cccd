from services.kvstore.config import KvStoreConfig
from services.kvstore.service import serve
from shared.runtime import service_main

if __name__ == "__main__":
    service_main("kvstore", KvStoreConfig, serve)
