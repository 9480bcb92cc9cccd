"""A vision-language model's prompt with images (docs/vision.md): each image's bytes decoded
and checked (format, pixels), then transformers' own processor for the model (Idefics3's:
resize, split into tiles and a global view, normalize) makes the pixel tensors and expands
each ``<image>`` of the rendered chat text into its placeholder tokens, exactly as transformers
does. Each image leaves as an ``ImageInput``: its hash, where its placeholders lie in the
prompt, its pixels and its patch mask. Plain synchronous code (the service runs it in a
thread pool, off the event loop)."""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from shared.errors import InvalidRequest
from shared.messages import ImageInput
from shared.sections.media import MAX_PIXEL_BYTES

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what an image part may be encoded as
IMAGE_TOKEN = "<image>"


def is_vision_language(model_config: dict) -> bool:
    """Whether config.json is a model this tier preprocesses images for (Idefics3,
    Qwen2.5-VL: qwen_images.py)."""
    return (model_config.get("architectures") or [None])[0] in (
        "Idefics3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def decode_image(data: bytes, max_pixels: int, index: int = 0) -> Image.Image:
    """The image of ``data`` as RGB; a 400 naming the cause for a corrupt image, one of
    another format than FORMATS, or one of more than ``max_pixels`` pixels."""
    where = f"image {index + 1}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise InvalidRequest(f"{where}: unsupported image format {image.format} "
                                     f"(supported: {', '.join(FORMATS)})",
                                     param="messages", code="unsupported_image_format")
            width, height = image.size
            if width * height > max_pixels:
                raise InvalidRequest(f"{where} has {width} x {height} = {width * height} "
                                     f"pixels, over the limit of {max_pixels} "
                                     f"(--max-image-pixels)", param="messages",
                                     code="image_too_large")
            image.load()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(f"{where} could not be decoded: {exc}", param="messages",
                             code="invalid_image") from exc
    return image.convert("RGB")


def compact_pixels(tiles: np.ndarray, image_processor) -> tuple[np.ndarray, np.ndarray] | None:
    """tiles [N, C, H, W] float32 -> (codes [N, C, H, W] uint8, table [C, 256] float32) with
    table[c][codes[:, c]] == tiles[:, c] exactly, or None where no such table exists. A
    value's code is the 8-bit pixel the processor's rescale and normalize made it from."""
    mean = np.asarray(getattr(image_processor, "image_mean", None) or [0.0] * tiles.shape[1],
                      np.float64)
    std = np.asarray(getattr(image_processor, "image_std", None) or [1.0] * tiles.shape[1],
                     np.float64)
    scale = getattr(image_processor, "rescale_factor", 1 / 255) or 1 / 255
    codes = np.empty(tiles.shape, np.uint8)
    table = np.zeros((tiles.shape[1], 256), np.float32)
    for channel in range(tiles.shape[1]):
        values = tiles[:, channel]
        code = np.clip(np.rint((values * std[channel] + mean[channel]) / scale), 0, 255)
        codes[:, channel] = code
        table[channel, codes[:, channel]] = values
        if not np.array_equal(table[channel][codes[:, channel]], values):
            return None
    return codes, table


def check_pixel_bytes(inputs: list[ImageInput], units: str) -> None:
    """A request's preprocessed pixels must fit the message that carries them (``units``:
    what they were cut into, for the error)."""
    num_bytes = sum(len(image.pixels) for image in inputs)
    if num_bytes > MAX_PIXEL_BYTES:
        raise InvalidRequest(f"the images are {num_bytes} bytes of pixels once preprocessed "
                             f"({units}), over the {MAX_PIXEL_BYTES} a request's message "
                             f"carries: send fewer or smaller images", param="messages",
                             code="image_too_large")


def image_hash(pixels: np.ndarray, patch_mask: bytes) -> bytes:
    """blake2b-128 of the tensor's shape, dtype, bytes and patch mask."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((pixels.shape, str(pixels.dtype))).encode())
    digest.update(np.ascontiguousarray(pixels).data)
    digest.update(patch_mask)
    return digest.digest()


class ImagePrompts:
    """One vision-language model's processor (transformers' AutoProcessor)."""

    def __init__(self, model_dir: str | Path, tokenizer) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.processor.tokenizer = tokenizer  # (the codec's: one vocabulary)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.global_token_id = tokenizer.convert_tokens_to_ids("<global-img>")
        self.tokens_per_tile = self.processor.image_seq_len
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.patch_size = config["vision_config"]["patch_size"]  # the patch mask's cut

    def encode(self, text: str, images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        """The rendered chat ``text`` (one ``<image>`` per image, in order) -> (token ids
        with each image's placeholders expanded, the images for the worker)."""
        if text.count(IMAGE_TOKEN) != len(images):
            raise InvalidRequest(f"the prompt holds {text.count(IMAGE_TOKEN)} image markers "
                                 f"for {len(images)} images", param="messages")
        out = self.processor(text=text, images=[images], add_special_tokens=False,
                             return_tensors="np")
        token_ids = out["input_ids"][0].tolist()
        pixels = out["pixel_values"][0].astype(np.float32)  # [tiles, C, H, W]
        pixel_mask = out.get("pixel_attention_mask")
        spans = self.image_spans(token_ids)
        if len(spans) != len(images):
            raise ValueError(f"{len(spans)} image placeholder runs for {len(images)} images")
        inputs, first_tile = [], 0
        for offset, length, num_tiles in spans:
            tiles = np.ascontiguousarray(pixels[first_tile:first_tile + num_tiles])
            mask = b"" if pixel_mask is None else self.patch_mask(
                pixel_mask[0][first_tile:first_tile + num_tiles])
            first_tile += num_tiles
            inputs.append(self.image_input(tiles, mask, offset, length))
        check_pixel_bytes(inputs, f"{pixels.shape[0]} tiles")
        return token_ids, inputs

    def image_input(self, tiles: np.ndarray, mask: bytes, offset: int, length: int
                    ) -> ImageInput:
        """One image's message: its pixels as codes and a table where that is exact
        (``compact_pixels``), else as float32."""
        compact = compact_pixels(tiles, self.processor.image_processor)
        codes, table = compact if compact is not None else (tiles, None)
        return ImageInput(hash=image_hash(tiles, mask), offset=offset, length=length,
                          pixel_shape=list(tiles.shape), pixels=codes.tobytes(),
                          patch_mask=mask, pixel_dtype="float32" if table is None else "uint8",
                          pixel_table=b"" if table is None else table.tobytes())

    def image_spans(self, token_ids: list[int]) -> list[tuple[int, int, int]]:
        """Each image's (offset of its first image token, positions up to its last one,
        tiles): an image's runs of image tokens end with the one after ``<global-img>``."""
        spans, start, num_tiles = [], None, 0
        ids = np.asarray(token_ids)
        is_image = ids == self.image_token_id
        run_starts = np.nonzero(is_image & ~np.concatenate([[False], is_image[:-1]]))[0]
        for run_start in run_starts:
            if start is None:
                start = int(run_start)
            num_tiles += 1
            if run_start > 0 and ids[run_start - 1] == self.global_token_id:
                end = int(run_start) + self.tokens_per_tile
                spans.append((start, end - start, num_tiles))
                start, num_tiles = None, 0
        return spans

    def patch_mask(self, pixel_mask: np.ndarray) -> bytes:
        """[tiles, H, W] pixel mask -> the patches holding any pixel, one byte each
        (b"": all of them), as transformers cuts it."""
        tiles, height, width = pixel_mask.shape
        p = self.patch_size
        patches = pixel_mask.reshape(tiles, height // p, p, width // p, p).sum(axis=(2, 4)) > 0
        return b"" if patches.all() else patches.astype(np.uint8).tobytes()
