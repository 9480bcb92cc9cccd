"""A Llama-family decoder (Llama 2/3/3.1, SmolLM, Mistral-style) over the paged KV cache.

RMSNorm, rotary embedding (default, linear and Llama-3.1 "llama3" scaling), SwiGLU MLP, grouped-query
attention, optionally tied embeddings. Tokens of all sequences in a step are flattened into one
batch: ``input_ids [num_tokens]`` and ``positions [num_tokens]``; ``AttentionMetadata`` says which
sequence each token belongs to and where its keys and values live. Weights load from a Hugging Face
directory (``config.json`` + ``*.safetensors``, HF parameter names); q/k/v and gate/up projections are
fused at load time so each is one matmul.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kernels.paged_attention import paged_attention_ref, write_kv_cache_ref

log = structlog.get_logger()


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict  # rope_type, rope_theta and the scaling fields of that type
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        if config.get("sliding_window"):
            log.warning("sliding_window_ignored", sliding_window=config["sliding_window"])
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_parameters=_rope_parameters(config),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False))

    @classmethod
    def from_path(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads((path / "config.json").read_text()))


def _rope_parameters(config: dict) -> dict:
    """transformers 5 writes ``rope_parameters``; older configs, rope_theta and rope_scaling."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return params


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies, [head_dim // 2] fp32 on CPU (as transformers computes them)."""
    params, dim = config.rope_parameters, config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short kept, the middle band interpolated."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's tokens start
    logits_indices: torch.Tensor  # [num_sampled] int64: tokens whose logits are returned


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, dim]
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half ("neox") rotary embedding.

    x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, head_dim]
    """
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.value_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv_cache_ref(k, v, self.key_cache, self.value_cache, metadata.slot_mapping)
        out = paged_attention_ref(q, self.key_cache, self.value_cache, metadata.block_tables,
                                  metadata.seq_lens, metadata.query_start_loc, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))  # [num_tokens, hidden_size]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, intermediate_size] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.register_buffer("inv_freq", compute_inv_freq(config), persistent=False)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Hand each layer views of its cache.

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        """
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            layer.self_attn.key_cache, layer.self_attn.value_cache = layer_cache[0], layer_cache[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> logits [num_sampled, vocab_size] (fp32)."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, metadata)
        x = self.norm(x[metadata.logits_indices])  # [num_sampled, hidden_size]
        head_weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head_weight).float()  # [num_sampled, vocab_size]


def load_model(path: Path, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Build the model from a Hugging Face directory without materializing random weights first."""
    config = ModelConfig.from_path(path)
    with torch.device("meta"):
        model = Transformer(config)
    state_dict = _fuse_hf_weights(_read_safetensors(path, device, dtype), config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.inv_freq = compute_inv_freq(config).to(device)  # the meta-built buffer is empty
    return model.eval()


def _read_safetensors(path: Path, device: torch.device, dtype: torch.dtype
                      ) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb" not in name:
                    tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors


def _fuse_hf_weights(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (``model.layers.0.self_attn.q_proj.weight``, ...) -> this module's names."""
    hf = {name.removeprefix("model."): tensor for name, tensor in hf.items()}
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    elif "lm_head.weight" not in hf:
        raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    fused = {}
    for name, tensor in hf.items():
        prefix, _, suffix = name.rpartition(".")  # suffix: weight or bias
        if prefix.endswith(("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")):
            continue  # consumed with q_proj / gate_proj
        if prefix.endswith("self_attn.q_proj"):
            base = prefix.removesuffix("q_proj")
            parts = [hf[f"{base}{p}_proj.{suffix}"] for p in ("q", "k", "v")]
            fused[f"{base}qkv_proj.{suffix}"] = torch.cat(parts, dim=0)
        elif prefix.endswith("mlp.gate_proj"):
            base = prefix.removesuffix("gate_proj")
            parts = [hf[f"{base}gate_proj.{suffix}"], hf[f"{base}up_proj.{suffix}"]]
            fused[f"{base}gate_up_proj.{suffix}"] = torch.cat(parts, dim=0)
        else:
            fused[name] = tensor
    return fused
