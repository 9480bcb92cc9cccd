"""Qwen2.5-VL's prompt with images (docs/vision.md): transformers' own processor for it
(Qwen2VLImageProcessor: smart_resize to multiples of patch_size * merge_size within
min_pixels and max_pixels, rescale, normalize, the image repeated to temporal_patch_size
frames and cut into flattened patches in merge-block order, the grid (t, h, w)), and each
``<|image_pad|>`` of the rendered chat text expanded to ``t * h * w / merge_size ** 2`` of
them, exactly as Qwen2_5_VLProcessor does. Each image leaves as an ``ImageInput`` with its
grid; its pixels travel as codes and a table where that is exact (images.compact_pixels).

transformers' PIL image processor is used (its default backend needs torchvision, which
flotilla does not install), and the processor is Qwen2_5_VLProcessor's image and text side
(its video processor needs torchvision too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from services.tokenizer.images import check_pixel_bytes, compact_pixels, image_hash
from shared.errors import InvalidRequest
from shared.messages import ImageInput

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
IMAGE_PAD = "<|image_pad|>"


def image_text_processor(image_processor, tokenizer):
    """transformers' Qwen2_5_VLProcessor over an image processor and a tokenizer only."""
    from transformers import Qwen2_5_VLProcessor

    class ImageTextProcessor(Qwen2_5_VLProcessor):
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    return ImageTextProcessor(image_processor=image_processor, tokenizer=tokenizer)


class QwenImagePrompts:
    """One Qwen2.5-VL model's processor."""

    def __init__(self, model_dir: str | Path, tokenizer) -> None:
        from transformers import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        self.processor = image_text_processor(image_processor, tokenizer)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.merge_size = image_processor.merge_size
        self.channels = 3

    def encode(self, text: str, images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        """The rendered chat ``text`` (one ``<|image_pad|>`` per image, in order) -> (token
        ids with each image's placeholders expanded, the images for the worker)."""
        if text.count(IMAGE_PAD) != len(images):
            raise InvalidRequest(f"the prompt holds {text.count(IMAGE_PAD)} image markers "
                                 f"for {len(images)} images", param="messages")
        out = self.processor(text=[text], images=images, add_special_tokens=False,
                             return_tensors="np")
        token_ids = out["input_ids"][0].tolist()
        pixels = out["pixel_values"].astype(np.float32)  # [patches, C * T * P * P]
        grids = out["image_grid_thw"].astype(np.int64)  # [images, 3]
        spans = image_spans(token_ids, self.image_token_id)
        if len(spans) != len(images):
            raise ValueError(f"{len(spans)} image placeholder runs for {len(images)} images")
        inputs, first = [], 0
        for (offset, length), grid in zip(spans, grids, strict=True):
            num_patches = int(np.prod(grid))
            if length * self.merge_size ** 2 != num_patches:
                raise ValueError(f"{length} placeholders for an image grid {grid.tolist()}")
            patches = pixels[first:first + num_patches].reshape(num_patches, self.channels, -1)
            first += num_patches
            inputs.append(self.image_input(np.ascontiguousarray(patches), grid, offset, length))
        check_pixel_bytes(inputs, f"{pixels.shape[0]} patches")
        return token_ids, inputs

    def image_input(self, patches: np.ndarray, grid: np.ndarray, offset: int, length: int
                    ) -> ImageInput:
        """patches [t * h * w, C, T * P * P]: one image's message (the grid hashed with its
        pixels: two grids of as many patches are different images)."""
        compact = compact_pixels(patches, self.processor.image_processor)
        codes, table = compact if compact is not None else (patches, None)
        return ImageInput(hash=image_hash(patches, grid.tobytes()), offset=offset,
                          length=length, pixel_shape=list(patches.shape),
                          pixels=codes.tobytes(),
                          pixel_dtype="float32" if table is None else "uint8",
                          pixel_table=b"" if table is None else table.tobytes(),
                          grid_thw=[int(x) for x in grid])


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """Each run of image tokens: (offset, length)."""
    is_image = np.asarray(token_ids) == image_token_id
    edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
    starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]
