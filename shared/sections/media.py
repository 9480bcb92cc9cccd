"""Images in prompts (docs/vision.md): what the gateway fetches and accepts, how the tokenizer
tier preprocesses them, and what the worker keeps of their encodings."""

from __future__ import annotations

import json
from typing import Annotated

from shared.config import Section, check_number, knob

DEFAULT_IMAGES_PER_PROMPT = 4
# the nats-server flotilla serve starts takes messages up to this size (NATS' own cap; its
# default is 1 MiB): a prompt's preprocessed images travel in its messages (docs/vision.md)
NATS_MAX_PAYLOAD = 64 * 1024 * 1024
# ... and buffers this much for one connection before closing it as a slow consumer (its
# default, 64 MiB, is a burst of a few dozen requests' pixels for a gateway whose loop is busy
# reading their bodies)
NATS_MAX_PENDING = 512 * 1024 * 1024
# a request's pixel tensors, in all, may take this much of one message (the rest: its tokens)
MAX_PIXEL_BYTES = 48 * 1024 * 1024


class MediaInput(Section, frozen=True, kw_only=True):
    """Read by the gateway (fetching, the limits it checks before anything else) and the
    tokenizer (the limits that need a decoded image)."""

    limit_mm_per_prompt: Annotated[str, knob(
        f"most items of each modality in one prompt, as JSON (vLLM's form): "
        f"'{{\"image\": 2}}' (default: {DEFAULT_IMAGES_PER_PROMPT} images)")] = ""
    allowed_media_domains: Annotated[str, knob(
        "hosts whose http(s) image URLs the gateway fetches, comma-separated (default: none; "
        "data: URLs always work)")] = ""
    allowed_local_media_path: Annotated[str, knob(
        "a directory whose files file:// image URLs may name (default: none)")] = ""
    max_image_bytes: Annotated[int, knob(
        "largest encoded image accepted (a data URL's decoded bytes, a fetched file)")] = \
        10 * 1024 * 1024
    max_image_pixels: Annotated[int, knob(
        "most pixels (width x height) of one decoded image")] = 4096 * 4096
    media_fetch_timeout_s: Annotated[float, knob(
        "deadline of one http(s) image fetch")] = 5.0
    image_preprocess_timeout_s: Annotated[float, knob(
        "deadline of the tokenizer tier's work on one request's images, its wait for a "
        "free image worker included (a burst of image requests queues there)")] = 60.0

    def __post_init__(self) -> None:
        self.mm_limits  # (parsed: a bad value names itself)
        for name in ("max_image_bytes", "max_image_pixels"):
            check_number(getattr(self, name), name, minimum=1)
        check_number(self.media_fetch_timeout_s, "media_fetch_timeout_s")

    @property
    def mm_limits(self) -> dict[str, int]:
        """limit_mm_per_prompt parsed: modality -> most items."""
        return parse_mm_limits(self.limit_mm_per_prompt)

    @property
    def media_domains(self) -> frozenset[str]:
        return frozenset(host.strip().lower() for host in self.allowed_media_domains.split(",")
                         if host.strip())


def parse_mm_limits(text: str) -> dict[str, int]:
    """'{"image": 2}' -> {"image": 2}; "" -> the default. A ValueError names a bad value."""
    limits = {"image": DEFAULT_IMAGES_PER_PROMPT}
    if not text.strip():
        return limits
    try:
        given = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"limit_mm_per_prompt is not JSON: {text!r}") from exc
    if not isinstance(given, dict):
        raise ValueError(f"limit_mm_per_prompt must be a JSON object, e.g. '{{\"image\": 2}}'")
    for modality, count in given.items():
        if modality != "image":
            raise ValueError(f"limit_mm_per_prompt: modality {modality!r} is not served "
                             f"(image)")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt: {modality} must be a count >= 0, "
                             f"not {count!r}")
    return {**limits, **given}


class ImagePreprocessing(Section, frozen=True, kw_only=True):
    """The tokenizer's image work."""

    image_workers: Annotated[int, knob(
        "threads that decode, resize, tile and normalize images, off the tokenizer's event "
        "loop")] = 2

    def __post_init__(self) -> None:
        if self.image_workers < 1:
            raise ValueError("image_workers must be at least 1")


class EncoderCache(Section, frozen=True, kw_only=True):
    """The worker's vision encoder."""

    encoder_cache_size: Annotated[int, knob(
        "images whose encoder outputs the worker keeps (LRU by image hash), so a repeated "
        "image encodes once (0: none kept)")] = 64
    max_encoder_batch_tokens: Annotated[int, knob(
        "image tokens (the language model's, one per encoder output row) in one vision tower "
        "call: a step's images encode together up to this, which bounds the encoder's "
        "activation memory (an image larger than it encodes alone)")] = 8192

    def __post_init__(self) -> None:
        if self.encoder_cache_size < 0:
            raise ValueError("encoder_cache_size must be 0 or more")
        if self.max_encoder_batch_tokens < 1:
            raise ValueError("max_encoder_batch_tokens must be at least 1")
