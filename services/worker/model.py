"""One decoder for the Llama family (Llama 2/3/3.1, SmolLM, Mistral, Qwen2/2.5, Qwen3) over the paged
KV cache.

RMSNorm, rotary embedding (default, linear and Llama-3.1 "llama3" scaling), SwiGLU MLP, grouped-query
attention, optionally tied embeddings. The families differ only in a few switches on ``ModelConfig``:
biases on q/k/v (Qwen2) or on all projections (Llama ``attention_bias``), per-head RMSNorm of q and k
before rotary (Qwen3), an explicit ``head_dim``, and a sliding window (Mistral v0.1), which is not
implemented: it caps the usable context instead. Tokens of all sequences in a step are flattened into
one batch: ``input_ids [num_tokens]`` and ``positions [num_tokens]``; ``AttentionMetadata`` says which
sequence each token belongs to and where its keys and values live. q/k/v and gate/up projections (and
their biases) are fused so each is one matmul; ``weights.py`` loads them.

The compute ops (RMSNorm with the residual add fused, rotary with the KV write, the gate_up
projection with SiLU-and-mul, paged attention) come from ``services/worker/ops.py``: Triton kernels on CUDA, their torch
references on CPU. Each residual add is fused into the norm after it, and a layer ends with the
next layer's input norm: o_proj and down go through ``ops.linear_add_rms_norm``, which at decode
sizes can do the add and the norm in the projection's split-K reduce (``ops.norm_in_reduce``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
from torch import nn

from kernels.paged_attention import AttentionPlan
from kernels.rotary import build_cos_sin_cache
from services.worker import ops
from services.worker.cpu_attention import DecodeContext
from services.worker.fp8_checkpoints import checkpoint_fp8
from services.worker.tensor_parallel import TensorParallel, VocabParallelEmbedding

log = structlog.get_logger()


# architectures[0] in config.json (or, when that is empty, model_type) -> family
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


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
    family: str = "llama"  # a value of ARCHITECTURES
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q_proj, k_proj, v_proj have biases
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before rotary (Qwen3)
    sliding_window: int | None = None  # the window some layers use (not implemented: caps context)
    # "fp8": the projections' weights (not embeddings, norms or lm_head) are FP8 with a scale
    # per output channel (``Linear``): the checkpoint's own (fp8_checkpoints.py) or
    # --quantization fp8's; "none": all in the model's dtype
    quantization: str = "none"
    batch_invariant: bool = False  # --batch-invariant (ops.py), passed by each layer to its ops

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        family = _family(config)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        num_heads = config["num_attention_heads"]
        # Llama's attention_bias covers all four projections; Qwen2 always has q/k/v biases only;
        # Mistral has none. Only Llama has mlp_bias.
        attention_bias = config.get("attention_bias", False) and family in ("llama", "qwen3")
        default_head_dim = 128 if family == "qwen3" else config["hidden_size"] // num_heads
        model_config = cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or default_head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_parameters=_rope_parameters(config),
            max_position_embeddings=config.get("max_position_embeddings", 2048), family=family,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=attention_bias or family == "qwen2", o_proj_bias=attention_bias,
            mlp_bias=family == "llama" and config.get("mlp_bias", False),
            qk_norm=family == "qwen3", sliding_window=_sliding_window(config, family),
            quantization="fp8" if checkpoint_fp8(config) else "none")
        if model_config.sliding_window is not None:
            log.warning("sliding_window_caps_context", sliding_window=model_config.sliding_window,
                        max_position_embeddings=model_config.max_position_embeddings)
        return model_config

    @classmethod
    def from_path(cls, path: Path) -> ModelConfig:
        return cls.from_dict(json.loads((path / "config.json").read_text()))

    def usable_context_len(self, requested: int = 0) -> int:
        """``requested`` (0: max_position_embeddings), capped to the sliding window if there is
        one: within the window, attention over everything equals sliding-window attention."""
        context_len = requested or self.max_position_embeddings
        return min(context_len, self.sliding_window) if self.sliding_window else context_len


def _family(config: dict) -> str:
    architectures = config.get("architectures") or []
    if architectures:
        if architectures[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architectures[0]!r} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
        return ARCHITECTURES[architectures[0]]
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES.values():
        raise ValueError(f"unsupported model_type {model_type!r} and no architectures in "
                         f"config.json (supported: {', '.join(ARCHITECTURES.values())})")
    return model_type


def _sliding_window(config: dict, family: str) -> int | None:
    """The sliding window if any layer uses one and it is shorter than the context, else None.

    Mistral slides in every layer when ``sliding_window`` is set (v0.1: 4096); Qwen2/3 only with
    ``use_sliding_window``, in the layers ``layer_types`` (or ``max_window_layers``) name; Llama
    never (transformers ignores the key too).
    """
    window = config.get("sliding_window")
    if not window or family == "llama":
        return None
    if family in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False):
            return None
        layer_types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(config["num_hidden_layers"])]
        if "sliding_attention" not in layer_types:
            return None
    return window if window < config.get("max_position_embeddings", 2048) else None


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
    # Host-side bounds, so GPU kernels size their launch without reading the tensors back
    # (CUDA graphs pass the largest values they must serve).
    max_query_len: int = 0
    max_seq_len: int = 0
    num_decodes: int = 0  # the first num_decodes sequences have one query each
    # every token's logits, in order (logits_indices is all of them): no gather before the head
    all_logits: bool = False
    # [num_tokens] int64: the row of the step in flight whose sampled token is this token's
    # input, -1 for the rest (None: no such token; step_inputs.fill_pending_inputs)
    pending_source_rows: torch.Tensor | None = None
    # the step's attention launches, planned by its first layer (ops.attention); not copied
    # by dataclasses.replace, so metadata with other lengths never runs an old plan
    attention_plan: AttentionPlan | None = field(default=None, init=False, repr=False,
                                                 compare=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., dim] -> normed x; with a residual, (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Linear):
    """nn.Linear whose weight may be FP8 (e4m3) with ``weight_scale`` [out_features] fp32, one
    scale per output channel (kernels/fp8.py); without FP8 that buffer is None. With ``reduce``
    (tensor parallel o_proj and down: a slice of the input features) the ranks' partial
    outputs are summed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: ModelConfig,
                 reduce: TensorParallel | None = None):
        super().__init__(in_features, out_features, bias=bias)
        fp8 = config.quantization == "fp8"
        self.register_buffer("weight_scale", torch.empty(out_features) if fp8 else None)
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.batch_invariant = config.batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.linear(x, self.weight, self.bias, self.weight_scale,
                         batch_invariant=self.batch_invariant)
        return out if self.reduce is None else self.reduce.all_reduce(out)


def add_rms_norm(x: torch.Tensor, proj: Linear, residual: torch.Tensor, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(proj(x) + residual), proj(x) + residual), the sum written into residual: in the
    projection's reduce where ``ops.linear_add_rms_norm`` can, after the ranks' sum when
    tensor parallel."""
    if proj.reduce is not None:
        return proj.reduce.linear_add_rms_norm(x, proj, residual, norm)
    return ops.linear_add_rms_norm(x, proj.weight, proj.bias, residual, norm.weight, norm.eps,
                                   proj.weight_scale, proj.batch_invariant)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale, self.batch_invariant = config.head_dim ** -0.5, config.batch_invariant
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               config.qkv_bias, config)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, config, tp)
        if config.qk_norm:  # Qwen3: one [head_dim] weight shared by all heads
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.key_cache: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.value_cache: torch.Tensor | None = None
        # an FP8 cache holds keys / k_scale and values / v_scale (kv_quant.py sets them)
        self.k_scale, self.v_scale = 1.0, 1.0
        self.decode_context: DecodeContext | None = None  # CPU: the decode rows' context, kept

    def project(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> the rotated queries [num_tokens, num_heads, head_dim];
        the keys and values are written to the cache. Reads no host-side metadata, so a CUDA
        graph can hold it (``cuda_graphs.PiecewiseGraphs``)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k rotated in place; k and v written to the cache
        ops.rotary_and_write_kv_cache(q, k, v, positions, cos_sin_cache, self.key_cache,
                                      self.value_cache, slot_mapping, self.k_scale, self.v_scale)
        return q

    def attend(self, q: torch.Tensor, metadata: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] -> attention output, the same shape (into
        ``out`` when given)."""
        return ops.attention(q, self.key_cache, self.value_cache, metadata, self.scale,
                             self.decode_context, out=out, k_scale=self.k_scale,
                             v_scale=self.v_scale, batch_invariant=self.batch_invariant)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   config.mlp_bias, config)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, config.mlp_bias,
                                config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of gate_up: [num_tokens, hidden_size] -> [num_tokens, intermediate_size]."""
        up = self.gate_up_proj
        return ops.linear_silu_and_mul(x, up.weight, up.bias, up.weight_scale, up.batch_invariant)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, metadata: AttentionMetadata, normed: bool = False,
                next_norm: RMSNorm | None = None, kv_ready: Sequence[torch.cuda.Event] = ()
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``before_attention``, attention (after ``kv_ready``), ``after_attention``: (x,
        residual) as they take and return them."""
        q, residual = self.before_attention(x, residual, positions, cos_sin_cache,
                                            metadata.slot_mapping, normed)
        if kv_ready:
            wait_events(kv_ready)
        return self.after_attention(self.self_attn.attend(q, metadata), residual, next_norm)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, normed: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input minus the residual stream so far (the whole input when
        residual is None), or with ``normed`` this layer's input norm of the stream (the
        previous layer's ``after_attention`` applied it) -> (queries [num_tokens, num_heads,
        head_dim], the residual stream)."""
        if normed:
            h = x
        elif residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.self_attn.project(h, positions, cos_sin_cache, slot_mapping), residual

    def after_attention(self, attention_out: torch.Tensor, residual: torch.Tensor,
                        next_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """attention_out [num_tokens, num_heads, head_dim] -> (the MLP's output, the residual
        stream before it); with ``next_norm`` (the next layer's input norm, or the final one),
        (next_norm of the stream after this layer, that stream). Both adds are written into
        ``residual`` in place."""
        h, residual = add_rms_norm(attention_out.flatten(1), self.self_attn.o_proj, residual,
                                   self.post_attention_layernorm)
        if next_norm is None:
            return self.mlp(h), residual
        return add_rms_norm(self.mlp.gated(h), self.mlp.down_proj, residual, next_norm)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        """``config``: the whole model's; with ``tp`` this rank builds its part of it
        (tensor_parallel.py) and ``self.config`` is that part's."""
        super().__init__()
        self.tp = tp
        self.config = config = tp.local_config(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                   config)
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, self.embed_tokens.num_embeddings, bias=False))
        self.register_buffer("inv_freq", compute_inv_freq(config), persistent=False)
        # [max_position_embeddings, head_dim] fp32: cos then sin of position * inv_freq
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(
            self.inv_freq, config.max_position_embeddings), persistent=False)

    def bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        """Hand each layer views of its cache.

        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        """
        if kv_cache is None:  # unbind (after the memory profile's scratch cache)
            for layer in self.layers:
                layer.self_attn.key_cache = layer.self_attn.value_cache = None
                layer.self_attn.decode_context = None
            return
        # CPU: decode contexts kept from step to step. They hold what the cache holds for the
        # decoding sequences, plus padding and shared prefixes copied per sequence: cap them at
        # twice the cache (a larger batch falls back to gathering each step)
        context_bytes = 2 * kv_cache.nbytes // len(self.layers)
        for layer, layer_cache in zip(self.layers, kv_cache, strict=True):
            layer.self_attn.key_cache, layer.self_attn.value_cache = layer_cache[0], layer_cache[1]
            layer.self_attn.decode_context = (None if kv_cache.is_cuda
                                              else DecodeContext(context_bytes))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata,
                layer_waits: Sequence[Sequence[torch.cuda.Event]] | None = None,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> logits [num_sampled, vocab_size] (fp32).
        ``layer_waits``: per layer, events its attention waits for (KV blocks loading in
        layer groups, kv_tiers.py). ``logits_out``: written and returned (a CUDA graph's
        static buffer)."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        # Each layer ends with the next one's input norm; the last one with the final norm
        # only where down's reduce carries it (elsewhere ``logits`` normalizes just the
        # sampled rows)
        down = self.layers[-1].mlp.down_proj
        final_norm = self.norm if down.reduce is None and ops.norm_in_reduce(
            x.shape[0], down.weight, x, self.norm.weight) else None
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [final_norm]
        residual, normed = None, False
        for index, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True)):
            x, residual = layer(x, residual, positions, self.cos_sin_cache, metadata, normed,
                                next_norm, layer_waits[index] if layer_waits is not None else ())
            normed = next_norm is not None
        indices = None if metadata.all_logits else metadata.logits_indices
        if normed:
            return self.head(x if indices is None else x[indices], logits_out)
        return self.logits(x, residual, indices, logits_out)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, indices: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's (x, residual) [num_tokens, hidden_size] -> logits of the rows
        ``indices`` (None: all) [num_sampled, vocab_size] (fp32; into ``out`` when given)."""
        if indices is not None:
            x, residual = x[indices], residual[indices]
        x, _ = self.norm(x, residual)  # [num_sampled, hidden_size]
        return self.head(x, out)

    def head(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed rows [num_sampled, hidden_size] -> logits [num_sampled, vocab_size]
        (fp32; into ``out`` when given)."""
        head_weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        invariant = self.config.batch_invariant
        if self.tp.size == 1 and out is not None:
            return ops.linear(x, head_weight, out=out, batch_invariant=invariant)
        logits = ops.linear(x, head_weight, batch_invariant=invariant)  # [num_sampled, rank's rows]
        logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.float() if out is None else out.copy_(logits)


def wait_events(events: Sequence[torch.cuda.Event]) -> None:
    """The current stream waits on the device for ``events`` (none: no call at all)."""
    for event in events:
        torch.cuda.current_stream().wait_event(event)
