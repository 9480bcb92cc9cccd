"""Tokenizer service configuration."""

from __future__ import annotations

from shared.config import ServiceConfig


class TokenizerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla tokenizer: chat templates, encode/decode, incremental detokenization."""

    max_model_len: int = 0  # 0: the model's max_position_embeddings

    __help__ = {"max_model_len": "context length limit (0: the model's own)"}
