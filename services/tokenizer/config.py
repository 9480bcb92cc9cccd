"""Tokenizer service configuration."""

from __future__ import annotations

from shared import limits
from shared.config import ServiceConfig


class TokenizerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla tokenizer: chat templates, encode/decode, incremental detokenization."""

    max_model_len: int = limits.MAX_MODEL_LEN  # the worker's too (shared/limits.py)
    served_model_name: str = ""  # the API's name of the model; "": the model's own

    __help__ = {**limits.CONTEXT_LIMIT_HELP,
                "served_model_name": "the model's name in the API: /v1/models lists it and "
                                     "requests must use it (default: the model's own name)"}

    def __post_init__(self) -> None:
        limits.check_context_limit(self.max_model_len)
