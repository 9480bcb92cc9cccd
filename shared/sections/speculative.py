"""Speculative decoding's settings: ``--speculative-config``, JSON with vLLM's field names,
decoded once into ``SpeculativeConfig`` and handed whole to the scheduler (which drafts) and
the worker (which sizes its verify steps' graphs by K and loads a draft model). What each
method does: docs/speculative-decoding.md. Benchmark-only modes (replayed drafts, synthetic
acceptance) are not here: benchmarks install them in process
(benchmarks/speculation_plugins.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shared.config import Section, knob

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
WORKER_METHODS = ("draft_model", "eagle", "eagle3")  # the worker fills the draft slots


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix looked up
    # no drafts while more requests than this run: a large batch keeps the device busy, and
    # a rejected draft then costs as much as a real token (0: no limit)
    disable_by_batch_size: int = 16
    # the draft cap of each step learnt from measured throughput (draft_budget.py); false:
    # every drafted request gets up to num_speculative_tokens (a fixed K, as vLLM's)
    adaptive: bool = True
    # suffix: the longest suffix matched, the responses kept to match in, and the drafts per
    # matched token (vLLM's names; vLLM's defaults 24, 10,000, 1.0)
    suffix_decoding_max_tree_depth: int = 16
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    # draft_model: the model the worker drafts with (as --model takes it: a directory, a
    # .gguf, smollm2, dummy:<preset>); the same tokenizer as the served model's. eagle3,
    # eagle: the EAGLE head's directory (or dummy:<head preset>, shared/presets/eagle/)
    model: str = ""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported "
                             f"(one of: {', '.join(METHODS)})")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 1 and 16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must be 0 (no limit) or more")
        if not self.prompt_lookup_min <= self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError("need prompt_lookup_min <= suffix_decoding_max_tree_depth <= 64")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be 0 (none) or more")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if (self.method in WORKER_METHODS) != bool(self.model):
            raise ValueError(f"model goes with methods {', '.join(WORKER_METHODS)}, and each "
                             f"needs one")


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """``--speculative-config``'s JSON; "" (the default): no speculation."""
    if not text.strip():
        return None
    try:
        return msgspec.json.decode(text.encode(), type=SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None


class Speculation(Section, frozen=True, kw_only=True):
    """The scheduler drafts by it; the worker sizes its verify graphs by K and loads the
    draft model (method draft_model)."""

    speculative_config: Annotated[SpeculativeConfig | None, knob(
        "speculative decoding, JSON with vLLM's field names, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4}' (prompt lookup; \"suffix\" also matches recent "
        "responses; \"draft_model\" with \"model\": DIR drafts with a smaller model of the "
        "same tokenizer; \"eagle3\" or \"eagle\" with \"model\": an EAGLE head's DIR): greedy requests keep their text, sampled ones their distribution "
        "(docs/speculative-decoding.md)")] = None

    @property
    def num_speculative_tokens(self) -> int:
        """K, the drafts a request a step (0: no speculation)."""
        return 0 if self.speculative_config is None else \
            self.speculative_config.num_speculative_tokens

    @property
    def draft_model(self) -> str:
        """The draft model of method draft_model, as --model takes it ("": none)."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method == "draft_model" else ""

    @property
    def eagle_head(self) -> str:
        """The EAGLE head of methods eagle3 and eagle ("": none)."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method in ("eagle", "eagle3") else ""
