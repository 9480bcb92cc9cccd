"""Where images enter a step (docs/vision.md): each request's preprocessed images, the vision
tower run for the first chunk that reaches an image's placeholders, its output kept in an LRU
by image hash (so later chunks, later requests and a repeated image in a chat reuse it), and
the embedding rows that replace the placeholders' token embeddings in the step's forward.

``NoImages`` is the null side (a text-only model: a request with images is refused);
``ImageEncoder`` the vision-language one. Encoder counts since the last report travel on a
step's result (``attach``) to the scheduler's stats and the gateway's /metrics.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np
import structlog
import torch

from safetensors import safe_open

from services.worker.step_inputs import SequenceChunk
from services.worker.transfer import to_device
from services.worker.vision import VisionSpec, VisionTower, vision_tensors
from shared.messages import ImageInput, StepResult
from shared.models import ModelFiles
from shared.sections.media import EncoderCache

log = structlog.get_logger()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "uint8": torch.uint8}  # uint8: codes, and a table of each code's value


class NoImages:
    """A text-only model: no images, nothing added to a step."""

    active = False

    def add(self, request_id: str, images: Sequence[ImageInput],
            token_ids: Sequence[int] = ()) -> None:
        if images:
            raise ValueError(f"request {request_id} has images but the model is text-only")

    def forget(self, request_id: str) -> None:
        pass

    def step_rows(self, chunks: Sequence[SequenceChunk], request_ids: Sequence[str],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def step_positions(self, chunks: Sequence[SequenceChunk], request_ids: Sequence[str],
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the step's positions, a cos/sin table of its own or None): a model with
        positions of its own for image prompts (M-RoPE: qwen_images.py) changes them."""
        return positions, None

    def attach(self, results: list[StepResult]) -> list[StepResult]:
        return results

    def warm_up(self) -> None:
        pass


class EncoderOutputCache:
    """Encoder outputs by image hash, least recently used evicted past ``capacity`` images
    (0: none kept, every chunk that needs an image encodes it)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class ImageEncoder:
    """A vision-language model's image side of a step."""

    active = True

    def __init__(self, tower: VisionTower, cache_size: int, device: torch.device,
                 dtype: torch.dtype, max_batch_tokens: int = 8192):
        self.tower, self.device, self.dtype = tower, device, dtype
        self.max_batch_tokens = max_batch_tokens  # image tokens in one tower call
        self.cache = EncoderOutputCache(cache_size)
        self._images: dict[str, list[tuple[ImageInput, np.ndarray]]] = {}
        self.num_encoded = self.num_hits = 0  # since start
        self.encoder_time_s = 0.0  # the tower's calls that have ended (GPU: by their events)
        self._timed_calls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._reported = (0, 0, 0.0)

    def add(self, request_id: str, images: Sequence[ImageInput],
            token_ids: Sequence[int] = ()) -> None:
        """``token_ids``: the request's prompt (where each image's tokens are)."""
        image_token_id = self.tower.spec.image_token_id
        placed = []
        for image in images:
            self._check(request_id, image)
            span = np.asarray(token_ids[image.offset:image.offset + image.length])
            positions = image.offset + np.nonzero(span == image_token_id)[0]  # [tokens]
            if not len(positions):
                raise ValueError(f"request {request_id}: no image token at the image's "
                                 f"placeholders [{image.offset}, {image.offset + image.length})")
            placed.append((image, positions))
        self._images[request_id] = placed

    def forget(self, request_id: str) -> None:
        self._images.pop(request_id, None)

    step_positions = NoImages.step_positions  # (Idefics3: 1D positions as for text)

    def step_rows(self, chunks: Sequence[SequenceChunk], request_ids: Sequence[str],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image rows: (indices [n] int64 into the step's tokens, embeddings
        [n, text_hidden]), or None when no chunk reaches an image's placeholders. An image
        is encoded (or found in the cache) by the first chunk that needs it, the step's
        images together (``_outputs``); a chunk that ends inside its placeholders takes the
        rows it covers, the next chunk the rest."""
        needed = []  # (request, image, its token positions, rows lo:hi, step row of position 0)
        first_row = 0
        for chunk, request_id in zip(chunks, request_ids, strict=True):
            start, end = chunk.start, chunk.start + len(chunk.token_ids)
            for image, positions in self._images.get(request_id, ()):
                lo, hi = np.searchsorted(positions, (start, end))
                if lo != hi:
                    needed.append((request_id, image, positions, lo, hi, first_row - start))
            first_row += len(chunk.token_ids)
        if not needed:
            return None
        outputs = self._outputs([image for _, image, *_ in needed])
        rows: list[np.ndarray] = []
        embeds: list[torch.Tensor] = []
        for request_id, image, positions, lo, hi, row_of_zero in needed:
            output = outputs[image.hash]
            if output.shape[0] != len(positions):
                raise ValueError(f"request {request_id}: {len(positions)} image tokens "
                                 f"for {output.shape[0]} image embeddings")
            rows.append(row_of_zero + positions[lo:hi])
            embeds.append(output[lo:hi])
        indices = to_device(torch.from_numpy(np.concatenate(rows).astype(np.int64)), self.device)
        return indices, torch.cat(embeds).to(dtype)

    def _outputs(self, images: Sequence[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings [tokens, text_hidden] by hash: from the cache, or encoded
        now, the missing ones in tower calls of up to ``max_batch_tokens`` image tokens."""
        outputs: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            if image.hash in outputs or image.hash in missing:
                continue
            cached = self.cache.get(image.hash)
            if cached is not None:
                self.num_hits += 1
                outputs[image.hash] = cached
            elif not image.pixels:
                raise ValueError(f"image {image.hash.hex()}: a chunk needs it but it came "
                                 f"without its pixels (the scheduler sends them for "
                                 f"uncomputed images)")
            else:
                missing[image.hash] = image
        for group in self._groups(list(missing.values())):
            outputs.update(zip((image.hash for image in group), self._encode(group)))
        return outputs

    def _groups(self, images: list[ImageInput]) -> list[list[ImageInput]]:
        """The images in tower calls: consecutive images of one batch key, each call up to
        ``max_batch_tokens`` image tokens (an image larger than that alone)."""
        groups: list[list[ImageInput]] = []
        tokens = 0
        for image in images:
            size = self._num_tokens(image)
            if groups and self._batch_key(groups[-1][0]) == self._batch_key(image) \
                    and tokens + size <= self.max_batch_tokens:
                groups[-1].append(image)
                tokens += size
            else:
                groups.append([image])
                tokens = size
        return groups

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """One tower call over ``images``: each one's embeddings, kept in the cache. On a GPU
        the call is only queued (the step's forward follows it on the stream) and timed by
        events, read once they have passed (``_collect_times``)."""
        cuda = self.device.type == "cuda"
        started = time.perf_counter()
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        with torch.inference_mode():
            outputs = self._run_tower(images)
        if cuda:
            events[1].record()
            self._timed_calls.append(events)
        else:
            self.encoder_time_s += time.perf_counter() - started
        self.num_encoded += len(images)
        for image, output in zip(images, outputs, strict=True):
            self.cache.put(image.hash, output)
        log.debug("images_encoded", num_images=len(images))
        return outputs

    def _collect_times(self) -> None:
        """Add the GPU time of the tower calls whose end has passed."""
        while self._timed_calls and self._timed_calls[0][1].query():
            start, end = self._timed_calls.pop(0)
            self.encoder_time_s += start.elapsed_time(end) / 1000

    def warm_up(self) -> None:
        """One tower call on blank input before serving, so what compiles or plans on first
        use (Triton kernels, cuDNN's attention plans) does so before the first image: in
        issue 53's first run on an H200, the first image's step took 2.5-5 s."""
        started = time.perf_counter()
        with torch.inference_mode():
            self._warm_up_tower()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        log.info("encoder_warmed_up", seconds=round(time.perf_counter() - started, 2))

    def _warm_up_tower(self) -> None:
        spec = self.tower.spec
        side = spec.image_size
        pixels = torch.zeros(2, spec.num_channels, side, side, device=self.device,
                             dtype=self.dtype)
        mask = torch.ones(2, side // spec.patch_size, side // spec.patch_size,
                          dtype=torch.bool, device=self.device)
        mask[1, -1] = False  # a padded tile's path too
        self.tower(pixels, mask)

    def _num_tokens(self, image: ImageInput) -> int:
        return image.pixel_shape[0] * self.tower.spec.tokens_per_tile

    def _batch_key(self, image: ImageInput) -> tuple[int, ...]:
        """Images batch when their tiles have one shape."""
        return tuple(image.pixel_shape[1:])

    def _run_tower(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The images' tiles in one batch -> each image's [tiles * tokens_per_tile, hidden]."""
        pixels, masks = zip(*(self._tensors(image) for image in images))
        output = self.tower(torch.cat(pixels), torch.cat(masks))
        return list(output.split([self._num_tokens(image) for image in images]))

    def _tensors(self, image: ImageInput) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixels [tiles, C, H, W] on the device in the tower's dtype, patch_mask [tiles,
        H/p, W/p] bool)."""
        shape = tuple(image.pixel_shape)
        pixels = image_pixels(image, self.device).to(self.dtype)
        patch = self.tower.spec.patch_size
        mask_shape = (shape[0], shape[2] // patch, shape[3] // patch)
        if image.patch_mask:
            mask = torch.frombuffer(bytearray(image.patch_mask), dtype=torch.bool)
            mask = to_device(mask.view(mask_shape), self.device)
        else:
            mask = torch.ones(mask_shape, dtype=torch.bool, device=self.device)
        return pixels, mask

    def _check(self, request_id: str, image: ImageInput) -> None:
        """A clear error for an image the tower cannot take (the tokenizer tier made it)."""
        spec = self.tower.spec
        shape = image.pixel_shape
        if image.pixel_dtype not in _DTYPES:
            raise ValueError(f"request {request_id}: image pixel dtype {image.pixel_dtype!r}")
        if len(shape) != 4 or shape[1] != spec.num_channels or shape[2] % spec.patch_size \
                or shape[3] % spec.patch_size:
            raise ValueError(f"request {request_id}: image pixel shape {shape} is not [tiles, "
                             f"{spec.num_channels}, H, W] in {spec.patch_size}-pixel patches")
        itemsize = _DTYPES[image.pixel_dtype].itemsize
        if image.pixels and len(image.pixels) != int(np.prod(shape)) * itemsize:
            raise ValueError(f"request {request_id}: {len(image.pixels)} pixel bytes for "
                             f"shape {shape}")
        if image.pixels and image.pixel_dtype == "uint8" \
                and len(image.pixel_table) != shape[1] * 256 * 4:
            raise ValueError(f"request {request_id}: uint8 pixels need a [{shape[1]}, 256] "
                             f"float32 table, not {len(image.pixel_table)} bytes")

    def attach(self, results: list[StepResult]) -> list[StepResult]:
        """The last result carries the encoder's counts since the previous one that did."""
        if not results:
            return results
        self._collect_times()
        now = (self.num_encoded, self.num_hits, self.encoder_time_s)
        if now == self._reported:
            return results
        encoded, hits, seconds = (a - b for a, b in zip(now, self._reported))
        self._reported = now
        results[-1] = msgspec.structs.replace(results[-1], num_images_encoded=encoded,
                                              num_encoder_cache_hits=hits,
                                              encoder_time_s=seconds)
        return results


def image_pixels(image: ImageInput, device: torch.device | str = "cpu") -> torch.Tensor:
    """The image's pixel tensor [tiles, C, H, W] on ``device``, in its own dtype (float32 for
    codes and a table: table[c][code] per channel). Codes are looked up on ``device``: a
    quarter of the bytes cross to a GPU, and the gather runs there."""
    shape, device = tuple(image.pixel_shape), torch.device(device)
    pixels = torch.frombuffer(bytearray(image.pixels), dtype=_DTYPES[image.pixel_dtype])
    pixels = to_device(pixels.view(shape), device)
    if image.pixel_dtype != "uint8":
        return pixels
    table = torch.frombuffer(bytearray(image.pixel_table), dtype=torch.float32)
    table = to_device(table.view(shape[1], 256), device)  # each channel's value of each code
    # table[c, code] for every value: the flat table indexed by c * 256 + code
    channel_base = torch.arange(shape[1], device=device) * 256
    channel_base = channel_base.view(1, -1, *[1] * (len(shape) - 2))
    return table.flatten()[pixels.long() + channel_base]


def load_image_encoder(model_files: ModelFiles, device: torch.device, dtype: torch.dtype,
                       encoder: EncoderCache, tensor_parallel_size: int = 1
                       ) -> ImageEncoder | NoImages:
    """The model's image side: ``NoImages`` for a text-only model, else its tower and
    connector from the checkpoint (in ``dtype``), with ``encoder``'s cache and batch sizes."""
    spec = VisionSpec.from_dict(model_files.config)
    if spec is None:
        return NoImages()
    if model_files.dummy:
        raise ValueError("a dummy vision-language model is not built yet (docs/vision.md)")
    if tensor_parallel_size > 1:
        raise ValueError("a vision-language model runs on one worker process: "
                         "tensor_parallel_size > 1 is not built for its tower yet")
    tensors = {}
    for file in sorted(model_files.path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.startswith(("model.vision_model.", "model.connector.")):
                    tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    with torch.device("meta"):
        tower = VisionTower(spec)
    tower.requires_grad_(False)
    tower.load_state_dict(vision_tensors(tensors), strict=True, assign=True)
    log.info("vision_tower_loaded", num_layers=spec.num_layers, hidden_size=spec.hidden_size,
             tokens_per_tile=spec.tokens_per_tile, encoder_cache_size=encoder.encoder_cache_size)
    return ImageEncoder(tower.eval(), encoder.encoder_cache_size, device, dtype,
                        encoder.max_encoder_batch_tokens)
