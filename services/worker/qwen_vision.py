"""Qwen2.5-VL's image side: the windowed-attention vision transformer and its patch merger.

A preprocessed image (the tokenizer tier's work, transformers' Qwen2VLImageProcessor) is
``pixels [num_patches, channels * temporal_patch_size * patch_size ** 2]`` and its grid
``(t, h, w)`` of patches (``num_patches = t * h * w``), the patches ordered in blocks of
``merge_size x merge_size``. The tower: a Conv3d patch embedding (kernel = stride, so one
matmul per patch), 2D rotary positions (each head's first half of frequencies rotated by the
patch's row, the second by its column), pre-norm blocks (RMSNorm, bidirectional attention,
RMSNorm, SwiGLU MLP with biases) attending within windows of ``window_size`` pixels, except
the blocks ``fullatt_block_indexes`` that attend over the whole image; the merger (RMSNorm,
each merge block's patches joined into one vector, a GELU MLP to the language model's width):
``t * h * w / merge_size ** 2`` embeddings, one per ``<|image_pad|>`` token. Module names
mirror the Hub checkpoint's (``visual.*``; transformers 5 saves ``model.visual.*``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from services.worker import ops
from services.worker.transfer import to_device

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
# The MLP's width is padded with zeros to a multiple of this: cuBLAS's Hopper GEMMs need rows
# of 16 bytes (Qwen2.5-VL's 3420 bf16 are not) and fell back to an SM80 kernel, 62 of the
# tower's 101 ms for eight 640x640 images on an H200 (benchmarks/gpu/vision_encoder.py).
MLP_ALIGNMENT = 64


@dataclass(frozen=True)
class QwenVisionSpec:
    """The tower of a Qwen2.5-VL checkpoint, from its config.json."""

    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int
    num_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    window_size: int  # pixels
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float
    image_token_id: int

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, config: dict) -> QwenVisionSpec | None:
        """None for another architecture's config.json."""
        if (config.get("architectures") or [None])[0] != QWEN2_5_VL:
            return None
        vision = config["vision_config"]
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported vision hidden_act {vision['hidden_act']!r}")
        rope = vision.get("rope_parameters") or {}
        return cls(hidden_size=vision["hidden_size"],
                   intermediate_size=vision["intermediate_size"], depth=vision["depth"],
                   num_heads=vision["num_heads"], out_hidden_size=vision["out_hidden_size"],
                   num_channels=vision.get("in_channels", vision.get("in_chans", 3)),
                   patch_size=vision.get("patch_size", 14),
                   temporal_patch_size=vision.get("temporal_patch_size", 2),
                   merge_size=vision.get("spatial_merge_size", 2),
                   window_size=vision.get("window_size", 112),
                   fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())),
                   rope_theta=rope.get("rope_theta", 10000.0),
                   image_token_id=config["image_token_id"])


class RMSNorm(nn.Module):
    """A norm's weight and eps: the tower runs each with the residual add before it
    (ops.rms_norm in QwenVisionTower.encode and VisionBlock)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class PatchEmbed(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        kernel = (spec.temporal_patch_size, spec.patch_size, spec.patch_size)
        self.proj = nn.Conv3d(spec.num_channels, spec.hidden_size, kernel, kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[patches, patch_dim] -> [patches, hidden]: the convolution's one window a patch."""
        return F.linear(pixels, self.proj.weight.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.num_heads = spec.num_heads
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, windows: Windows
                ) -> torch.Tensor:
        """x [patches, hidden]; cos_sin [patches, head_dim] fp32 (each patch's cos, then sin,
        of its head_dim // 2 angles); windows: the groups of patches that attend to each
        other (an image's windows, or whole images)."""
        patches = x.shape[0]
        qkv = self.qkv(x).view(patches, 3, self.num_heads, -1)
        query, key, _ = qkv.unbind(1)
        ops.apply_rotary_fp32(query, key, cos_sin)  # (in place, in qkv)
        return self.proj(windows.attend(qkv).reshape(patches, -1))


class Windows:
    """Attention within windows, as one batched SDPA: the patches of each window (contiguous
    in the tower's order) gathered into rows of the longest window's length, a short window's
    spare slots repeating its first patch and masked out as keys (no gather and no mask when
    every window is whole, so the fused kernels take the patches as they lie)."""

    def __init__(self, window_of_patch: torch.Tensor, device: torch.device):
        """window_of_patch [patches] int64 on the CPU, ascending: each patch's window. The
        sizes are read on the host and the indices copied to ``device`` without a wait: a
        sync here held the step's host work until the step before it was done (the GPU
        then idle while the host prepared the language model's inputs)."""
        counts = torch.bincount(window_of_patch)
        self.num_windows, self.length = counts.numel(), int(counts.max())
        self.whole = bool((counts == self.length).all())
        self.padded_index = self.patch_of_slot = self.key_mask = None
        if not self.whole:
            starts = torch.cumsum(counts, 0) - counts
            slot = torch.arange(window_of_patch.numel()) - starts[window_of_patch]
            padded_index = window_of_patch * self.length + slot  # [patches]: their slots
            slots = torch.arange(self.length)[None]  # [1, length]
            patch_of_slot = (starts[:, None] + torch.minimum(  # [windows * length]
                slots, counts[:, None] - 1)).flatten()
            key_mask = (slots < counts[:, None]).view(self.num_windows, 1, 1, self.length)
            self.padded_index, self.patch_of_slot, self.key_mask = (
                to_device(t, device) for t in (padded_index, patch_of_slot, key_mask))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [patches, 3, heads, head_dim] -> [patches, heads, head_dim]"""
        padded = qkv if self.whole else qkv[self.patch_of_slot]  # [windows * length, 3, ...]
        query, key, value = padded.view(self.num_windows, self.length, *qkv.shape[1:]) \
            .permute(2, 0, 3, 1, 4).unbind(0)  # [windows, heads, length, head_dim] each
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.key_mask)
        out = out.transpose(1, 2).flatten(0, 1)  # [windows * length, heads, head_dim]
        return out if self.whole else out[self.padded_index]


class VisionMLP(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))
        return self.down_proj(gated)


class VisionBlock(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.norm1 = RMSNorm(spec.hidden_size)
        self.norm2 = RMSNorm(spec.hidden_size)
        self.attn = VisionAttention(spec)
        self.mlp = VisionMLP(spec)

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, cos_sin: torch.Tensor,
                windows: Windows, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm1(x), x) -> (next_norm(y), y) for the block's output y: each residual add
        runs in the RMSNorm after it (ops.rms_norm), ``residual`` updated in place."""
        attended = self.attn(normed, cos_sin, windows)
        normed, residual = ops.rms_norm(attended, self.norm2.weight, self.norm2.eps, residual)
        return ops.rms_norm(self.mlp(normed), next_norm.weight, next_norm.eps, residual)


class PatchMerger(nn.Module):
    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.merged_size = spec.hidden_size * spec.merge_size ** 2
        self.ln_q = RMSNorm(spec.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_size, self.merged_size), nn.GELU(),
                                 nn.Linear(self.merged_size, spec.out_hidden_size))

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """ln_q's output [patches, hidden] in merge blocks (the tower runs ln_q with the last
        block's residual add) -> [patches / merge^2, out_hidden]"""
        return self.mlp(normed.view(-1, self.merged_size))


class QwenVisionTower(nn.Module):
    """Qwen2.5-VL's ``visual``: one image's patches -> its embeddings."""

    def __init__(self, spec: QwenVisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)
        self.cpu_inv_freq = self.frequencies(spec)  # (patch angles are made on the host)

    @staticmethod
    def frequencies(spec: QwenVisionSpec) -> torch.Tensor:
        """Each axis' rotary frequencies: a quarter of the head (rows, columns, repeated)."""
        half = spec.hidden_size // spec.num_heads // 2
        exponents = torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half
        return 1.0 / spec.rope_theta ** exponents

    def forward(self, pixels: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """pixels [t * h * w, patch_dim] -> [t * h * w / merge^2, out_hidden], in the order of
        the image's ``<|image_pad|>`` tokens."""
        return self.encode(pixels, [grid_thw])[0]

    def encode(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]
               ) -> list[torch.Tensor]:
        """Several images in one pass: pixels [sum of t * h * w, patch_dim], the images'
        patches one after another -> each image's [t * h * w / merge^2, out_hidden]. The
        windows of all images attend as one batch, and so does each full-attention block's
        whole images (padded to the largest)."""
        unit = self.spec.merge_size ** 2
        # the layout is the grids' alone: built on the host, copied without a wait
        order, window_of, image_of = batch_order(grids, self.spec)  # (in merge blocks)
        device = pixels.device
        angles = torch.cat([patch_angles(grid, self.spec.merge_size, self.cpu_inv_freq)
                            for grid in grids])
        angles = to_device(angles.view(-1, unit, angles.shape[-1])[order].flatten(0, 1), device)
        order = to_device(order, device)
        x = self.patch_embed(pixels)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [patches, head_dim]
        windows = Windows(window_of.repeat_interleave(unit), device)
        whole_images = Windows(image_of.repeat_interleave(unit), device)
        norms = [block.norm1 for block in self.blocks[1:]] + [self.merger.ln_q]
        normed = ops.rms_norm(x, self.blocks[0].norm1.weight, self.blocks[0].norm1.eps)
        for index, (block, next_norm) in enumerate(zip(self.blocks, norms, strict=True)):
            full = index in self.spec.fullatt_block_indexes
            normed, x = block(normed, x, cos_sin, whole_images if full else windows, next_norm)
        merged = self.merger(normed)[torch.argsort(order)]
        return list(merged.split([t * h * w // unit for t, h, w in grids]))


def batch_order(grids: Sequence[tuple[int, int, int]], spec: QwenVisionSpec
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """window_order over several images, their merge blocks one image after another:
    (order, window_of with windows numbered across the images, image_of) [blocks] each."""
    orders, windows_of, images_of = [], [], []
    num_blocks = num_windows = 0
    for image, grid in enumerate(grids):
        order, window_of = window_order(grid, spec)
        orders.append(order + num_blocks)
        windows_of.append(window_of + num_windows)
        images_of.append(torch.full_like(order, image))
        num_blocks += order.numel()
        num_windows += int(window_of.max()) + 1
    return torch.cat(orders), torch.cat(windows_of), torch.cat(images_of)


def patch_angles(grid_thw: tuple[int, int, int], merge: int, inv_freq: torch.Tensor
                 ) -> torch.Tensor:
    """[t * h * w, head_dim // 2] fp32 on the CPU (``inv_freq``'s): each patch's rotary angles
    (row frequencies, then column frequencies), patches in merge-block order as the
    processor lays them out."""
    t, h, w = grid_thw
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    rows = rows.permute(0, 2, 1, 3).flatten().repeat(t)
    cols = cols.permute(0, 2, 1, 3).flatten().repeat(t)
    return torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)


def window_order(grid_thw: tuple[int, int, int], spec: QwenVisionSpec
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [blocks]: the merge blocks window by window, each window's row-major;
    window_of [blocks]: each reordered block's window). A window is ``window_size`` pixels
    square (the last ones in a row or column cut short by the image's edge)."""
    t, h, w = grid_thw
    side = spec.window_size // spec.merge_size // spec.patch_size  # merge blocks a window
    blocks_h, blocks_w = h // spec.merge_size, w // spec.merge_size
    index = torch.arange(t * blocks_h * blocks_w).view(t, blocks_h, blocks_w)
    window_row = torch.arange(blocks_h)[:, None] // side
    window_col = torch.arange(blocks_w)[None, :] // side
    windows_w = -(-blocks_w // side)
    windows_per_frame = -(-blocks_h // side) * windows_w
    window = (torch.arange(t)[:, None, None] * windows_per_frame
              + window_row * windows_w + window_col)  # [t, blocks_h, blocks_w]
    # stable: within a window the blocks keep their row-major order
    order = torch.argsort(window.flatten(), stable=True)
    return index.flatten()[order], window.flatten()[order]


def build_tower(spec: QwenVisionSpec, tensors: dict[str, torch.Tensor]) -> QwenVisionTower:
    """The tower from a checkpoint's tensors (names without ``visual.``, on their device), its
    MLP padded to MLP_ALIGNMENT: zero gate/up rows and biases give silu(0) * 0 = 0, and the
    down projection's zero columns add nothing, so the output is the checkpoint's."""
    size = -(-spec.intermediate_size // MLP_ALIGNMENT) * MLP_ALIGNMENT
    extra = size - spec.intermediate_size
    tensors = dict(tensors)
    for index in range(spec.depth if extra else 0):
        prefix = f"blocks.{index}.mlp."
        for name in ("gate_proj.weight", "up_proj.weight"):
            tensors[prefix + name] = F.pad(tensors[prefix + name], (0, 0, 0, extra))
        for name in ("gate_proj.bias", "up_proj.bias"):
            tensors[prefix + name] = F.pad(tensors[prefix + name], (0, extra))
        tensors[prefix + "down_proj.weight"] = F.pad(tensors[prefix + "down_proj.weight"],
                                                     (0, extra))
    spec = replace(spec, intermediate_size=size)
    with torch.device("meta"):
        tower = QwenVisionTower(spec)
    tower.requires_grad_(False)
    tower.load_state_dict(tensors, strict=True, assign=True)
    return tower.eval()
