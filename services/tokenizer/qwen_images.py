"""Qwen2.5-VL's prompt with images (docs/vision.md): transformers' own processor for it
(Qwen2VLImageProcessor: smart_resize to multiples of patch_size * merge_size within
min_pixels and max_pixels, rescale, normalize, the image repeated to temporal_patch_size
frames and cut into flattened patches in merge-block order, the grid (t, h, w)), and each
``<|image_pad|>`` of the rendered chat text expanded to ``t * h * w / merge_size ** 2`` of
them, exactly as Qwen2_5_VLProcessor does. Each image leaves as an ``ImageInput`` with its
grid; its pixels travel as the resized 8-bit values of one frame (the processor's rescale and
normalize made a [channels, 256] table the worker looks them up in, exactly as the processor
would compute them): a quarter of float32's bytes, and half again for the repeated frame.

transformers' PIL image processor is used (its default backend needs torchvision, which
flotilla does not install), and the processor is Qwen2_5_VLProcessor's image and text side
(its video processor needs torchvision too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from services.tokenizer.images import check_pixel_bytes, image_hash
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
        self.temporal_patch_size = image_processor.temporal_patch_size
        self.channels = 3
        self.table = value_table(image_processor, self.channels)  # [C, 256] each code's value

    def encode(self, text: str, images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        """The rendered chat ``text`` (one ``<|image_pad|>`` per image, in order) -> (token
        ids with each image's placeholders expanded, the images for the worker)."""
        if text.count(IMAGE_PAD) != len(images):
            raise InvalidRequest(f"the prompt holds {text.count(IMAGE_PAD)} image markers "
                                 f"for {len(images)} images", param="messages")
        # the resized 8-bit pixels, patchified: rescaled and normalized by a table instead
        out = self.processor(text=[text], images=images, add_special_tokens=False,
                             return_tensors="np", do_rescale=False, do_normalize=False)
        token_ids = out["input_ids"][0].tolist()
        codes = out["pixel_values"]  # [patches, C * T * P * P], integers 0..255
        grids = out["image_grid_thw"].astype(np.int64)  # [images, 3]
        spans = image_spans(token_ids, self.image_token_id)
        if len(spans) != len(images):
            raise ValueError(f"{len(spans)} image placeholder runs for {len(images)} images")
        inputs, first = [], 0
        for (offset, length), grid in zip(spans, grids, strict=True):
            num_patches = int(np.prod(grid))
            if length * self.merge_size ** 2 != num_patches:
                raise ValueError(f"{length} placeholders for an image grid {grid.tolist()}")
            patches = codes[first:first + num_patches].reshape(num_patches, self.channels,
                                                                self.temporal_patch_size, -1)
            first += num_patches
            inputs.append(self.image_input(patches, grid, offset, length))
        check_pixel_bytes(inputs, f"{codes.shape[0]} patches")
        return token_ids, inputs

    def image_input(self, patches: np.ndarray, grid: np.ndarray, offset: int, length: int
                    ) -> ImageInput:
        """patches [t * h * w, C, T, P * P] of 8-bit values: one image's message, one frame of
        each patch (an image's T frames are the same picture), the codes hashed with the
        table and grid (two grids of as many patches are different images)."""
        frame = patches[:, :, 0]
        if not (patches == frame[:, :, None]).all():
            raise ValueError("an image's temporal frames differ")
        frame = np.ascontiguousarray(frame, dtype=np.uint8)  # [t * h * w, C, P * P]
        return ImageInput(hash=image_hash(frame, grid.tobytes() + self.table.tobytes()),
                          offset=offset, length=length, pixel_shape=list(frame.shape),
                          pixels=frame.tobytes(), pixel_dtype="uint8",
                          pixel_table=self.table.tobytes(), grid_thw=[int(x) for x in grid],
                          temporal_repeat=patches.shape[2])


def value_table(image_processor, channels: int) -> np.ndarray:
    """[channels, 256] float32: the value the processor's rescale and normalize make of each
    8-bit pixel in each channel (elementwise, so exactly what it gives for an image)."""
    levels = np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256)).copy()
    values = levels.astype(np.float32)
    if image_processor.do_rescale:
        values = image_processor.rescale(levels, image_processor.rescale_factor)
    if image_processor.do_normalize:
        values = image_processor.normalize(values, image_processor.image_mean,
                                           image_processor.image_std)
    return np.ascontiguousarray(values[:, 0], dtype=np.float32)


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """Each run of image tokens: (offset, length)."""
    is_image = np.asarray(token_ids) == image_token_id
    edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
    starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]
