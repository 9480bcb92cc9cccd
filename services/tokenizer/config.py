"""Tokenizer configuration: the sections it reads (shared/sections/), composed once."""

from __future__ import annotations

from shared.config import compose
from shared.sections.engine import ContextLimit
from shared.sections.gateway import ServedModel
from shared.sections.media import ImagePreprocessing, MediaInput
from shared.sections.runtime import COMMON

TokenizerConfig = compose(
    "TokenizerConfig",
    "flotilla tokenizer: chat templates, encode/decode, incremental detokenization.",
    (*COMMON, ContextLimit, ServedModel, MediaInput, ImagePreprocessing), module=__name__)
