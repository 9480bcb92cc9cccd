"""The wire messages of images in prompts (docs/vision.md): a chat message's parts, and an
image preprocessed by the tokenizer tier for the worker's encoder. Frozen msgspec Structs,
re-exported by shared/messages.py (the contract's one place to import from)."""

from __future__ import annotations

from msgspec import Struct


class ContentPart(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One part of a message with images, in order: its text, or the place of the
    request's next image (EncodeRequest.images)."""

    type: str  # "text" or "image"
    text: str = ""


class ImageInput(Struct, frozen=True, array_like=True, gc=False):
    """One image of a prompt as the tokenizer tier preprocessed it, for the worker's encoder.
    The prompt holds its placeholder tokens at [offset, offset + length)."""

    hash: bytes  # blake2b-128 of the pixel tensor (shape, dtype, bytes): the encoder cache's
    # and the prefix cache's key for the image
    offset: int  # the prompt position of its first placeholder token
    length: int  # positions its placeholders span (image tokens and the tile tags between)
    pixel_shape: list[int]  # [num_tiles, channels, height, width]
    # "float32": pixels holds the tensor; "uint8": a code per value, pixel_table the value
    # of each code per channel (exact: values made from 8-bit pixels by a per-channel
    # affine map take at most 256 per channel; a quarter of the bytes)
    pixel_dtype: str = "float32"
    pixels: bytes = b""  # the tensor's bytes (or codes), C order
    # [num_tiles, height / patch, width / patch] bool, one byte each: the patches holding
    # pixels (b"": every patch does)
    patch_mask: bytes = b""
    pixel_table: bytes = b""  # pixel_dtype "uint8": float32 [channels, 256]
    # Qwen2.5-VL: the image's grid of patches (t, h, w); pixels are then [t * h * w, channels,
    # temporal_patch * patch * patch], its placeholders t * h * w / merge^2 image tokens in a
    # row (empty: a tiled model's image, Idefics3's)
    grid_thw: list[int] = []
    # Qwen2.5-VL: pixels hold one temporal frame of each patch ([t * h * w, channels, patch *
    # patch]); the tower's patch repeats it this many times (an image's frames are equal)
    temporal_repeat: int = 1
