from services.tokenizer.config import TokenizerConfig
from services.tokenizer.service import serve
from shared.runtime import service_main

if __name__ == "__main__":
    service_main("tokenizer", TokenizerConfig, serve)
