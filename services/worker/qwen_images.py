"""Qwen2.5-VL's image side of a step (docs/vision.md): the encoder of image_inputs.py over
Qwen's tower (qwen_vision.py), and M-RoPE, the language model's 3D rotary positions.

M-RoPE: each token has a (temporal, height, width) position; the rotary frequencies are cut
into ``mrope_section`` (e.g. 16, 24, 24 of a 128-wide head's 64) and each section turns by
one of the three. A text token's three are equal: one position. An image's tokens (its
``<|image_pad|>`` run, ``t x h x w`` merge blocks) take ``(start + t', start + row, start +
col)`` with ``start`` the position after the text before it, and the text after it goes on
from the image's largest position + 1 (transformers' ``get_rope_index``). So a request's
positions are computed once, from its whole prompt and its images' grids, when it is added:
a chunk (chunked prefill, or the tail after a prefix-cache hit) looks its tokens' positions
up, and a token past them (a decode) is at ``index + delta``, the prompt's offset.

A step whose tokens all have one position each runs as any other (shifted positions, CUDA
graphs included); a step that holds image tokens passes the model a cos/sin table of its own
(a row per token, each section's columns from that section's position) and positions
0..n-1 into it, so the rotary kernels need no change."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch
import structlog
from safetensors import safe_open

from services.worker.image_inputs import (ImageEncoder, NoImages, image_pixels,
                                          load_image_encoder)
from services.worker.qwen_vision import QwenVisionSpec, QwenVisionTower, build_tower
from services.worker.step_inputs import SequenceChunk
from services.worker.transfer import to_device
from shared.messages import ImageInput
from shared.models import ModelFiles
from shared.sections.media import EncoderCache

log = structlog.get_logger()


def mrope_positions(num_tokens: int, images: Sequence[ImageInput], merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions: ([3, num_tokens] int64, delta: a later token at index
    i is at i + delta), as transformers' get_rope_index gives them for still images."""
    positions = np.empty((3, num_tokens), np.int64)
    index = current = 0  # the next token, the next text position
    for image in sorted(images, key=lambda image: image.offset):
        text = image.offset - index
        positions[:, index:image.offset] = current + np.arange(text)
        current += text
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        if t * h * w != image.length:
            raise ValueError(f"{image.length} placeholders for an image grid {image.grid_thw}")
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        positions[:, image.offset:image.offset + image.length] = current + grid.reshape(3, -1)
        current += max(h, w)
        index = image.offset + image.length
    positions[:, index:] = current + np.arange(num_tokens - index)
    return positions, int(current - index)


def mrope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  section_of_column: torch.Tensor) -> torch.Tensor:
    """positions [3, num_tokens] -> [num_tokens, rotary_dim]: each token's cos then sin, a
    column's angle from the position of its frequency's section."""
    index = positions[section_of_column].T  # [num_tokens, rotary_dim]
    return torch.gather(cos_sin_cache, 0, index.contiguous())


class QwenImageEncoder(ImageEncoder):
    """Qwen2.5-VL's images: the tower, the encoder cache, and each request's positions."""

    def __init__(self, tower: QwenVisionTower, mrope_section: Sequence[int], cache_size: int,
                 device: torch.device, dtype: torch.dtype, max_batch_tokens: int = 8192):
        super().__init__(tower, cache_size, device, dtype, max_batch_tokens)
        sections = np.repeat(np.arange(3), list(mrope_section))  # each frequency's section
        self.section_of_column = torch.from_numpy(np.concatenate([sections, sections])).to(
            device)
        self._positions: dict[str, tuple[np.ndarray, int]] = {}

    def add(self, request_id: str, images: Sequence[ImageInput],
            token_ids: Sequence[int] = ()) -> None:
        super().add(request_id, images, token_ids)
        self._positions.pop(request_id, None)
        if images:
            self._positions[request_id] = mrope_positions(len(token_ids), images,
                                                          self.tower.spec.merge_size)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self._positions.pop(request_id, None)

    def step_positions(self, chunks: Sequence[SequenceChunk], request_ids: Sequence[str],
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's (positions, its own cos/sin table or None): unchanged where no request
        of the step has images."""
        if not any(request_id in self._positions for request_id in request_ids):
            return positions, None
        parts = []
        for chunk, request_id in zip(chunks, request_ids, strict=True):
            index = chunk.start + np.arange(len(chunk.token_ids))
            table = self._positions.get(request_id)
            if table is None:
                parts.append(np.broadcast_to(index, (3, len(index))))
                continue
            prompt, delta = table
            inside = index < prompt.shape[1]
            parts.append(np.where(inside, prompt[:, np.minimum(index, prompt.shape[1] - 1)],
                                  index + delta))
        step = np.concatenate(parts, axis=1)  # [3, num_tokens]
        if (step == step[0]).all():
            return to_device(torch.from_numpy(step[0].copy()), positions.device), None
        cos_sin = mrope_cos_sin(to_device(torch.from_numpy(step), positions.device),
                                cos_sin_cache, self.section_of_column)
        return torch.arange(step.shape[1], device=positions.device), cos_sin

    def _warm_up_tower(self) -> None:
        """Two images in one call: one of whole windows, one whose edge windows are cut
        short (the masked attention)."""
        spec = self.tower.spec
        window = spec.window_size // spec.patch_size  # patches along a window's side
        grids = [(1, 2 * window, 2 * window), (1, window + spec.merge_size, 2 * window)]
        pixels = torch.zeros(sum(t * h * w for t, h, w in grids), spec.patch_dim,
                             device=self.device, dtype=self.dtype)
        self.tower.encode(pixels, grids)

    def _num_tokens(self, image: ImageInput) -> int:
        return int(np.prod(image.grid_thw)) // self.tower.spec.merge_size ** 2

    def _batch_key(self, image: ImageInput) -> tuple[int, ...]:
        return ()  # any sizes batch: the tower pads only within its attention groups

    def _run_tower(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The images' patches one after another, in one pass of the tower."""
        pixels = torch.cat([patch_pixels(image, self.device) for image in images])
        return self.tower.encode(pixels.to(self.dtype),
                                 [tuple(image.grid_thw) for image in images])

    def _check(self, request_id: str, image: ImageInput) -> None:
        """A clear error for an image the tower cannot take (the tokenizer tier made it)."""
        spec, shape = self.tower.spec, image.pixel_shape
        merge = spec.merge_size
        if len(image.grid_thw) != 3 or image.grid_thw[1] % merge or image.grid_thw[2] % merge:
            raise ValueError(f"request {request_id}: image grid {image.grid_thw} is not (t, h, "
                             f"w) in {merge} x {merge} merge blocks")
        repeat = image.temporal_repeat
        if len(shape) != 3 or shape[0] != int(np.prod(image.grid_thw)) or repeat < 1 \
                or shape[1] * shape[2] * repeat != spec.patch_dim:
            raise ValueError(f"request {request_id}: image pixel shape {shape} repeated "
                             f"{repeat} times is not [t * h * w, C, T * P * P] "
                             f"for grid {image.grid_thw} and {spec.patch_dim} values a patch")
        if image.pixel_dtype not in ("float32", "uint8"):
            raise ValueError(f"request {request_id}: image pixel dtype {image.pixel_dtype!r}")
        if not image.pixels:
            return  # an image of the cached prefix: its grid only (new_request_data)
        itemsize = 1 if image.pixel_dtype == "uint8" else 4
        if len(image.pixels) != int(np.prod(shape)) * itemsize:
            raise ValueError(f"request {request_id}: {len(image.pixels)} pixel bytes for "
                             f"shape {shape}")
        if image.pixel_dtype == "uint8" and len(image.pixel_table) != shape[1] * 256 * 4:
            raise ValueError(f"request {request_id}: uint8 pixels need a [{shape[1]}, 256] "
                             f"float32 table, not {len(image.pixel_table)} bytes")


def random_tower_tensors(spec: QwenVisionSpec, device: torch.device, dtype: torch.dtype,
                         seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """A dummy model's tower: norms 1, the rest N(0, std), each tensor from a generator
    seeded by (seed, name) on ``device`` (as weights.random_weights draws the decoder)."""
    with torch.device("meta"):
        tower = QwenVisionTower(spec)
    tensors = {}
    for name, param in tower.named_parameters():
        tensor = torch.empty(param.shape, device=device, dtype=dtype)
        if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
            tensor.fill_(1.0)
        else:
            generator = torch.Generator(device=device)
            generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            tensor.normal_(0.0, std, generator=generator)
        tensors[name] = tensor
    return tensors


def patch_pixels(image: ImageInput, device: torch.device | str = "cpu") -> torch.Tensor:
    """A Qwen2.5-VL image's patches [t * h * w, patch_dim] float32 on ``device``, each
    patch's sent frame repeated ``temporal_repeat`` times (the processor's layout)."""
    pixels = image_pixels(image, device)  # [patches, C, frame]
    if image.temporal_repeat > 1:  # [patches, C, T, frame]
        pixels = pixels.unsqueeze(2).expand(-1, -1, image.temporal_repeat, -1)
    return pixels.reshape(pixels.shape[0], -1)


def load_any_image_encoder(model_files: ModelFiles, device: torch.device, dtype: torch.dtype,
                           encoder: EncoderCache, tensor_parallel_size: int = 1
                           ) -> QwenImageEncoder | ImageEncoder | NoImages:
    """The model's image side: Qwen2.5-VL's, else image_inputs.load_image_encoder's
    (Idefics3's, or ``NoImages`` for a text-only model)."""
    spec = QwenVisionSpec.from_dict(model_files.config)
    if spec is None:
        return load_image_encoder(model_files, device, dtype, encoder, tensor_parallel_size)
    if tensor_parallel_size > 1:
        raise ValueError("a vision-language model runs on one worker process: "
                         "tensor_parallel_size > 1 is not built for its tower yet")
    return load_qwen_image_encoder(model_files, spec, device, dtype, encoder)


def load_qwen_image_encoder(model_files: ModelFiles, spec: QwenVisionSpec,
                            device: torch.device, dtype: torch.dtype, encoder: EncoderCache
                            ) -> QwenImageEncoder:
    """The tower from the checkpoint (``visual.*``, transformers 5's ``model.visual.*``), or
    random for a dummy model (``random_tower_tensors``)."""
    tensors = random_tower_tensors(spec, device, dtype) if model_files.dummy else {}
    for file in sorted(model_files.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(("visual.", "model.visual.")):
                    key = name.removeprefix("model.").removeprefix("visual.")
                    tensors[key] = f.get_tensor(name).to(device=device, dtype=dtype)
    tower = build_tower(spec, tensors)
    text = model_files.config.get("text_config") or model_files.config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    log.info("vision_tower_loaded", architecture="qwen2_5_vl", depth=spec.depth,
             hidden_size=spec.hidden_size, encoder_cache_size=encoder.encoder_cache_size)
    return QwenImageEncoder(tower, rope["mrope_section"], encoder.encoder_cache_size,
                            device, dtype, encoder.max_encoder_batch_tokens)
