"""Idefics3's (SmolVLM's) image side: the SigLIP vision tower and the connector that turns its
patches into language-model embeddings.

A preprocessed image (the tokenizer tier's work) is ``pixels [num_tiles, channels, H, W]``
(512-pixel tiles and a global view for SmolVLM) and ``patch_mask [num_tiles, H/p, W/p]`` (the
patches that hold pixels; padding does not). The tower: 16-pixel patches embedded by a
convolution, a learned position per patch (a tile smaller than the encoder's image size takes
positions spread over the whole grid, as NaViT does), pre-norm encoder layers (LayerNorm,
bidirectional attention over the tile's real patches, LayerNorm, GELU-tanh MLP), a final
LayerNorm. The connector: pixel shuffle (each ``scale`` x ``scale`` block of patches joined
into one vector) and a projection to the language model's hidden size, so a 512-pixel tile is
``(512 / 16 / 4) ** 2 = 64`` embeddings, in the order the prompt's ``<image>`` tokens take
them. Module names mirror the Hub checkpoint's (``vision_model.*``, ``connector.*``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IDEFICS3 = "Idefics3ForConditionalGeneration"
QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"  # (its tower: qwen_vision.py)


@dataclass(frozen=True)
class VisionSpec:
    """The tower and connector of a vision-language checkpoint, from its config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int  # the encoder's tile side in pixels
    patch_size: int
    layer_norm_eps: float
    scale_factor: int  # the connector's pixel shuffle
    text_hidden_size: int
    image_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    @classmethod
    def from_dict(cls, config: dict) -> VisionSpec | None:
        """None for a text-only config.json."""
        if (config.get("architectures") or [None])[0] != IDEFICS3:
            return None
        vision = config["vision_config"]
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported vision hidden_act {vision['hidden_act']!r}")
        return cls(hidden_size=vision["hidden_size"],
                   intermediate_size=vision["intermediate_size"],
                   num_layers=vision["num_hidden_layers"],
                   num_heads=vision["num_attention_heads"],
                   num_channels=vision.get("num_channels", 3), image_size=vision["image_size"],
                   patch_size=vision["patch_size"],
                   layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
                   scale_factor=config.get("scale_factor", 2),
                   text_hidden_size=config["text_config"]["hidden_size"],
                   image_token_id=config["image_token_id"])


def text_config_of(config: dict) -> dict:
    """The language model's config.json within a vision-language one (itself otherwise)."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture == QWEN2_5_VL:
        return qwen_text_config(config)
    if architecture != IDEFICS3:
        return config
    text = dict(config["text_config"])
    # the family comes from its model_type (Idefics3's default: llama); SmolVLM's text_config
    # names an architecture of its own (VLlama3ForCausalLM), a Llama all the same
    text["architectures"] = []
    text.setdefault("model_type", "llama")
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return text


def qwen_text_config(config: dict) -> dict:
    """Qwen2.5-VL's language model, a Qwen2: transformers 5's ``text_config`` or the Hub's
    top-level fields; its M-RoPE (``mrope_section``; the Hub's ``rope_scaling`` type
    "mrope") rotates by the default frequencies, positions chosen per section
    (qwen_mrope.py)."""
    text = dict(config.get("text_config") or {key: value for key, value in config.items()
                                              if key != "vision_config"})
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    if rope.pop("type", None) == "mrope" or rope.get("rope_type") == "mrope":
        rope["rope_type"] = "default"
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", text.get("rope_theta", 1000000.0))
    text.update(architectures=[], model_type="qwen2", rope_parameters=rope)
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return text


# the language model's tensors in vision-language checkpoints -> the decoder's HF names
_TEXT_PREFIXES = {"model.text_model.": "model.", "model.language_model.": "model."}
_VISION_PREFIXES = ("model.vision_model.", "model.connector.", "model.visual.", "visual.")


def split_checkpoint(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint's tensors -> the language model's under the decoder's
    HF names (Idefics3's ``model.text_model.x`` and transformers 5's Qwen2.5-VL
    ``model.language_model.x`` -> ``model.x``; the Hub's Qwen2.5-VL ``model.x`` and
    ``lm_head`` kept); the towers' and the connector's are left out (the image encoder loads
    them). A text checkpoint: unchanged."""
    if not any(name.startswith((*_TEXT_PREFIXES, *_VISION_PREFIXES)) for name in hf):
        return hf
    out = {}
    for name, tensor in hf.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name.removeprefix(prefix)
        out[name] = tensor
    return out


class VisionEmbeddings(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size,
                                         kernel_size=spec.patch_size, stride=spec.patch_size)
        self.position_embedding = nn.Embedding(spec.patches_per_side ** 2, spec.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, C, H, W], patch_mask [tiles, H/p, W/p] bool -> [tiles, patches,
        hidden]."""
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        return x + self.position_embedding(self.position_ids(patch_mask))

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, patches] int64: each real patch's place on the full grid, the tile's real
        rows and columns spread over it (fractional coordinates bucketed); padding 0."""
        side = self.spec.patches_per_side
        tiles, rows, cols = patch_mask.shape
        device = patch_mask.device
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        real_rows = patch_mask[:, :, 0].sum(dim=1)  # [tiles]
        real_cols = patch_mask[:, 0, :].sum(dim=1)
        row_frac = torch.arange(rows, device=device, dtype=torch.float32)[None] \
            * (1.0 / real_rows)[:, None]
        col_frac = torch.arange(cols, device=device, dtype=torch.float32)[None] \
            * (1.0 / real_cols)[:, None]
        row_bucket = torch.bucketize(row_frac.clamp(max=1 - 1e-6), boundaries, right=True)
        col_bucket = torch.bucketize(col_frac.clamp(max=1 - 1e-6), boundaries, right=True)
        ids = (row_bucket[:, :, None] * side + col_bucket[:, None, :]).reshape(tiles, -1)
        return torch.where(patch_mask.view(tiles, -1), ids, torch.zeros_like(ids))


class VisionAttention(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_heads, hidden // spec.num_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [tiles, patches, hidden]; key_mask [tiles, 1, 1, patches] bool (None: all real)."""
        tiles, patches, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # -> [tiles, heads, patches, head_dim]
            return t.view(tiles, patches, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
            attn_mask=key_mask, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(tiles, patches, hidden))


class VisionMLP(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionEncoderLayer(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = VisionAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = VisionMLP(spec)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(spec) for _ in range(spec.num_layers))


class VisionTransformer(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.embeddings = VisionEmbeddings(spec)
        self.encoder = VisionEncoder(spec)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """-> [tiles, patches, hidden]"""
        x = self.embeddings(pixels, patch_mask)
        key_mask = None if bool(patch_mask.all()) else patch_mask.view(
            patch_mask.shape[0], 1, 1, -1)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


class ModalityProjection(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.proj = nn.Linear(spec.hidden_size * spec.scale_factor ** 2, spec.text_hidden_size,
                              bias=False)


class Connector(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.scale = spec.scale_factor
        self.modality_projection = ModalityProjection(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[tiles, patches, hidden] -> [tiles, patches / scale^2, text_hidden]"""
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side * side, hidden] -> [tiles, (side / scale)^2, hidden * scale^2]: each
    scale x scale block of patches (row-major grid) becomes one vector, its patches in the
    order Idefics3 joins them (column blocks first, then row blocks)."""
    tiles, patches, hidden = x.shape
    side = int(patches ** 0.5)
    x = x.view(tiles, side, side // scale, hidden * scale)  # columns grouped
    x = x.permute(0, 2, 1, 3).reshape(tiles, side // scale, side // scale, hidden * scale ** 2)
    return x.permute(0, 2, 1, 3).reshape(tiles, patches // scale ** 2, hidden * scale ** 2)


class VisionTower(nn.Module):
    """The tower and the connector: an image's tiles -> its embeddings."""

    def __init__(self, spec: VisionSpec):
        super().__init__()
        self.spec = spec
        self.vision_model = VisionTransformer(spec)
        self.connector = Connector(spec)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """pixels [tiles, C, H, W], patch_mask [tiles, H/p, W/p] bool -> the image's
        embeddings [tiles * tokens_per_tile, text_hidden], in its placeholders' order."""
        out = self.connector(self.vision_model(pixels, patch_mask))
        return out.reshape(-1, out.shape[-1])


def vision_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tower's and connector's tensors of a checkpoint, under VisionTower's names."""
    return {name.removeprefix("model."): tensor for name, tensor in hf.items()
            if name.startswith(("model.vision_model.", "model.connector."))}
