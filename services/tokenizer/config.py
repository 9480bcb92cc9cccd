"""Tokenizer service configuration."""

from __future__ import annotations

from shared.config import ServiceConfig


class TokenizerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla tokenizer: chat templates, encode/decode, incremental detokenization."""

    max_model_len: int = 0  # 0: the model's max_position_embeddings
    served_model_name: str = ""  # the API's name of the model; "": the model's own

    __help__ = {"max_model_len": "context length limit (0: the model's own)",
                "served_model_name": "the model's name in the API: /v1/models lists it and "
                                     "requests must use it (default: the model's own name)"}
