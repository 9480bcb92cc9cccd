"""EAGLE heads (issue 52, methods ``eagle3`` and ``eagle``): one Llama decoder layer that
drafts from the served model's hidden states instead of from tokens alone.

Checkpoint layout (the public heads', e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and SpecForge's):

- **eagle3**: config.json (``LlamaForCausalLMEagle3``, ``draft_vocab_size``, optionally
  ``eagle_config.eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``) and tensors
  ``fc.weight`` [hidden, 3 * hidden] over the target's low/mid/high hidden states (the
  residual stream entering those layers; default layers 2, L // 2, L - 3), ``midlayer.*``
  (``input_layernorm`` of the token embeddings, ``hidden_norm`` of the fused feature, q/k/v
  over their concatenation [2 * hidden], o, post-attention norm, gate/up/down), ``norm``,
  ``lm_head`` [draft_vocab, hidden], ``d2t`` [draft_vocab] (target id = draft id + d2t) and
  ``t2d`` [vocab] bool (which target ids the draft vocabulary has); ``embed_tokens`` when the
  head has its own, else the target's.
- **eagle** (EAGLE-1): ``fc`` [hidden, 2 * hidden] (bias optional) over the concatenation of
  the token embedding and the target's last normed hidden state, ``layers.0.*`` (no input
  norm), drafting with the target's lm_head over its own vocabulary.

The layer's output before its final norm is the next draft pass's feature (a chain). Its KV
cache is paged by the served model's block tables (eagle_proposer.py). ``read_eagle_spec``
refuses a head that does not fit the served model, naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kernels.rotary import build_cos_sin_cache
from services.worker import ops
from services.worker.layers import MLP, Linear, RMSNorm
from services.worker.model import Attention, AttentionMetadata, ModelConfig, Transformer
from services.worker.model_config import compute_inv_freq
from services.worker.tensor_parallel import TensorParallel

EAGLE_METHODS = ("eagle", "eagle3")


@dataclass(frozen=True)
class EagleSpec:
    method: str  # "eagle3" or "eagle"
    config: ModelConfig  # the head's layer; vocab_size: the draft vocabulary's
    aux_layer_ids: tuple[int, ...]  # eagle3: the target layers whose input stream is fused
    norm_before_residual: bool = False  # eagle3: the fused feature normed before the residual
    own_embeddings: bool = False  # the checkpoint has embed_tokens
    fc_bias: bool = False  # eagle: fc.bias (some EAGLE-1 checkpoints have one)

    @property
    def captures_final(self) -> bool:
        """EAGLE-1 drafts from the target's last normed hidden state."""
        return self.method == "eagle"


def read_eagle_spec(path: Path, method: str, target: ModelConfig) -> EagleSpec:
    """The head in ``path`` checked against the served model (``target``): a mismatch is a
    ValueError naming the field."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"EAGLE head {path}: no config.json")
    raw = json.loads(config_path.read_text())
    names = _tensor_shapes(path)

    def refuse(field: str, detail: str) -> ValueError:
        return ValueError(f"EAGLE head {path}: {field} {detail}")

    for field, served in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if raw.get(field) != served:
            raise refuse(field, f"is {raw.get(field)}, the served model's is {served}")
    if raw.get("target_hidden_size", target.hidden_size) != target.hidden_size:
        raise refuse("target_hidden_size", f"is {raw['target_hidden_size']}, the served "
                     f"model's hidden_size is {target.hidden_size}")
    if raw.get("num_hidden_layers", 1) != 1:
        raise refuse("num_hidden_layers", f"is {raw['num_hidden_layers']}: one layer is supported")
    draft_vocab = raw.get("draft_vocab_size") or target.vocab_size
    if method == "eagle3":
        aux = tuple((raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or (
            2, target.num_layers // 2, target.num_layers - 3))
        if len(aux) != 3 or any(not 0 <= i < target.num_layers for i in aux):
            raise refuse("eagle_config.eagle_aux_hidden_state_layer_ids",
                         f"{list(aux)}: three layers of the served model's {target.num_layers}")
        _check_shape(names, "fc.weight", (target.hidden_size, 3 * target.hidden_size), refuse)
        _check_shape(names, "lm_head.weight", (draft_vocab, target.hidden_size), refuse)
        _check_vocab_maps(path, names, draft_vocab, target.vocab_size, refuse)
    else:
        aux = ()
        _check_shape(names, "fc.weight", (target.hidden_size, 2 * target.hidden_size), refuse)
        draft_vocab = target.vocab_size
    llama = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "num_hidden_layers": 1, "vocab_size": draft_vocab}
    config = dataclasses.replace(ModelConfig.from_dict(llama), quantization="none",
                                 batch_invariant=target.batch_invariant)
    return EagleSpec(method, config, aux, bool(raw.get("norm_before_residual", False)),
                     "embed_tokens.weight" in names, "fc.bias" in names)


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"EAGLE head {path}: no *.safetensors")
    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name.removeprefix("model.")] = tuple(f.get_slice(name).get_shape())
    return shapes


def _check_shape(names: dict, name: str, shape: tuple[int, ...], refuse) -> None:
    if names.get(name) != shape:
        raise refuse(name, f"has shape {list(names.get(name, ()))}, the served model needs "
                     f"{list(shape)}")


def _check_vocab_maps(path: Path, names: dict, draft_vocab: int, vocab: int, refuse) -> None:
    """``d2t`` must map every draft id to a distinct target id; ``t2d``, when present, mark
    exactly those target ids."""
    if draft_vocab == vocab and "d2t" not in names:
        return  # the whole vocabulary: no maps needed
    if names.get("d2t") != (draft_vocab,):
        raise refuse("d2t", f"has shape {list(names.get('d2t', ()))}, draft_vocab_size "
                     f"{draft_vocab} needs [{draft_vocab}]")
    tensors = _read(path, ("d2t", "t2d"))
    targets = torch.arange(draft_vocab) + tensors["d2t"].long()
    if targets.min() < 0 or targets.max() >= vocab or targets.unique().numel() != draft_vocab:
        raise refuse("d2t", f"maps draft ids outside the served model's {vocab} token ids "
                     f"(or two onto one)")
    if "t2d" in tensors:
        t2d = tensors["t2d"]
        if t2d.shape != (vocab,) or int(t2d.sum()) != draft_vocab \
                or not bool(t2d.bool()[targets].all()):
            raise refuse("t2d", f"does not mark the {draft_vocab} target ids d2t maps to "
                         f"(shape {list(t2d.shape)}, served vocabulary {vocab})")


def _read(path: Path, wanted: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                short = name.removeprefix("model.")
                if wanted is None or short in wanted:
                    tensors[short] = f.get_tensor(name)
    return tensors


class EagleHead(nn.Module):
    """The head's forward over the paged KV cache. Its features come in through
    ``feature_buffer`` and its output features leave through ``hidden_out`` (static buffers,
    so a decode graph (cuda_graphs.DecodeGraphs) can hold the head like a model)."""

    def __init__(self, spec: EagleSpec, target: Transformer, max_rows: int) -> None:
        super().__init__()
        config = self.config = spec.config
        self.spec, hidden = spec, config.hidden_size
        self.target = [target]  # (not a submodule: its weights are the target's)
        self.own_embed = nn.Embedding(target.config.vocab_size, hidden) \
            if spec.own_embeddings else None
        if spec.method == "eagle3":
            self.fc = None  # fused in the target's forward (hidden_capture.py)
            self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
            self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
            qkv_in = 2 * hidden
        else:
            self.fc = Linear(2 * hidden, hidden, spec.fc_bias, config)
            self.input_layernorm = self.hidden_norm = self.norm = self.lm_head = None
            qkv_in = hidden
        self.self_attn = Attention(config, TensorParallel())
        attn = self.self_attn
        attn.qkv_proj = Linear(qkv_in, attn.q_size + 2 * attn.kv_size, config.qkv_bias, config)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = MLP(config, TensorParallel())
        self.layers = [self]  # (what warm-up and graphs read: layers[0].self_attn)
        self.register_buffer("draft_to_target", torch.arange(config.vocab_size))
        self.register_buffer("inv_freq", compute_inv_freq(config), persistent=False)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(
            self.inv_freq, config.max_position_embeddings), persistent=False)
        dtype = target.embed_tokens.weight.dtype
        self.register_buffer("feature_buffer", torch.zeros(max_rows, hidden, dtype=dtype),
                             persistent=False)
        self.register_buffer("hidden_out", torch.zeros(max_rows, hidden, dtype=dtype),
                             persistent=False)

    @property
    def embed_tokens(self) -> nn.Module:
        """The head's own embeddings, or the served model's."""
        return self.own_embed if self.own_embed is not None else self.target[0].embed_tokens

    def bind_kv_cache(self, kv_cache: torch.Tensor | None) -> None:
        """kv_cache: [1, 2, num_blocks, block_size, num_kv_heads, head_dim] (None: unbind).
        No CPU decode context: a draft pass rewrites positions it held before."""
        attn = self.self_attn
        attn.key_cache, attn.value_cache = (None, None) if kv_cache is None else \
            (kv_cache[0, 0], kv_cache[0, 1])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata, logits_out: torch.Tensor | None = None
                ) -> torch.Tensor:
        """input_ids, positions [num_tokens], the features in ``feature_buffer[:num_tokens]``
        (each token's: the target's at the position before, or the pass before's output) ->
        logits of the sampled rows [num_sampled, vocab_size of the head] (fp32); every row's
        output feature into ``hidden_out``."""
        num_tokens = input_ids.shape[0]
        features = self.feature_buffer[:num_tokens]
        embeds = self.embed_tokens(input_ids)  # (the served model's: its TP shards too)
        if self.fc is not None:  # EAGLE-1: fc over (embedding, feature); no input norm
            residual = self.fc(torch.cat([embeds, features], dim=-1))
            h = residual
        else:
            normed = self.hidden_norm(features)
            residual = normed if self.spec.norm_before_residual else features
            h = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        q = self.self_attn.project(h, positions, self.cos_sin_cache, metadata.slot_mapping)
        out = self.self_attn.attend(q, metadata)
        h, residual = self.post_attention_layernorm(self.self_attn.o_proj(out.flatten(1)),
                                                    residual)
        stream = self.mlp(h) + residual  # [num_tokens, hidden]: the next pass's feature
        self.hidden_out[:num_tokens].copy_(stream)
        rows = stream if metadata.all_logits else stream[metadata.logits_indices]
        if self.lm_head is None:  # EAGLE-1: the target's head over its vocabulary
            logits = self.target[0].head(rows)
        else:
            logits = ops.linear(self.norm(rows), self.lm_head.weight).float()
        return logits if logits_out is None else logits_out.copy_(logits)

    def draft_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy drafts as target token ids [num_sampled] int64."""
        return self.draft_to_target[ops.greedy_token_ids(logits)]


def load_eagle_head(path: Path, spec: EagleSpec, target: Transformer, max_rows: int,
                    device: torch.device, dtype: torch.dtype) -> tuple[EagleHead, torch.Tensor | None]:
    """The head with its weights, and EAGLE-3's fc [hidden, 3 * hidden] (None for EAGLE-1),
    which the target's forward applies (hidden_capture.py)."""
    tensors = _read(path)
    head = EagleHead(spec, target, max_rows)
    state = {}
    for name, tensor in tensors.items():
        name = name.replace("midlayer.", "").replace("layers.0.", "")
        state[name.replace("embed_tokens.", "own_embed.")] = tensor
    fc = state.pop("fc.weight") if spec.method == "eagle3" else None
    for prefix in ("self_attn.", "mlp."):
        fused = (("qkv_proj", ("q_proj", "k_proj", "v_proj")) if prefix == "self_attn."
                 else ("gate_up_proj", ("gate_proj", "up_proj")))
        for suffix in ("weight", "bias"):
            parts = [state.pop(f"{prefix}{p}.{suffix}", None) for p in fused[1]]
            if all(p is not None for p in parts):
                state[f"{prefix}{fused[0]}.{suffix}"] = torch.cat(parts)
    if "d2t" in state:
        state["draft_to_target"] = torch.arange(spec.config.vocab_size) + state.pop("d2t").long()
    state.pop("t2d", None)
    state = {k: v for k, v in state.items() if not k.startswith("input_layernorm")
             or spec.method == "eagle3"}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in ("feature_buffer", "hidden_out", "draft_to_target")
               and not m.startswith(("inv_freq", "cos_sin_cache"))]
    if missing or unexpected:
        raise ValueError(f"EAGLE head {path}: tensors missing {missing}, unexpected {unexpected}")
    head = head.to(device=device)
    for parameter in head.parameters():
        parameter.data = parameter.data.to(dtype)
    head.feature_buffer = head.feature_buffer.to(dtype)
    head.hidden_out = head.hidden_out.to(dtype)
    head.requires_grad_(False)
    return head, None if fc is None else fc.to(device=device, dtype=dtype)
