"""Mixture-of-Experts checkpoints in the Hub's own layout, built from SmolLM2-135M-Instruct's real
weights: its attention, norms and embeddings, its MLP copied into each expert (with a small
per-expert change, or none: ``upcycled``), a seeded random router. Mixtral names experts
``block_sparse_moe.experts.{e}.w1/w2/w3``; Qwen2/3-MoE ``mlp.experts.{e}.gate_proj/up_proj/
down_proj``; Qwen3-MoE adds per-head q/k norms (weight 1 here), Qwen2-MoE q/k/v biases (0) and
a gated shared expert (SmolLM2's MLP). The tokenizer files come along, so ``flotilla serve
--model DIR`` and transformers both load the directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.models import resolve_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}


def moe_config(base: dict, family: str, num_experts: int, top_k: int, num_layers: int,
               dense_layers: tuple[int, ...] = ()) -> dict:
    """SmolLM2's config.json as an MoE family's (``dense_layers``: Qwen's mlp_only_layers)."""
    keep = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "hidden_act", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
            "eos_token_id", "pad_token_id", "tie_word_embeddings", "head_dim")
    config = {key: base[key] for key in keep}
    config.update(architectures=[ARCHITECTURES[family]], model_type=family,
                  num_hidden_layers=num_layers, num_experts_per_tok=top_k,
                  rope_theta=base["rope_parameters"]["rope_theta"], torch_dtype="float32")
    inter = base["intermediate_size"]
    if family == "mixtral":
        config.update(num_local_experts=num_experts, intermediate_size=inter)
    else:
        config.update(num_experts=num_experts, moe_intermediate_size=inter,
                      intermediate_size=inter, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=list(dense_layers), attention_bias=False,
                      use_sliding_window=False)
    if family == "qwen2_moe":
        config.update(shared_expert_intermediate_size=inter, norm_topk_prob=False)
    return config


def build_moe_checkpoint(out: Path, family: str, num_experts: int = 4, top_k: int = 2,
                         num_layers: int = 30, dense_layers: tuple[int, ...] = (),
                         upcycled: bool = False, seed: int = 0) -> Path:
    """A checkpoint directory at ``out`` (fp32); ``upcycled``: every expert SmolLM2's MLP."""
    smol = resolve_model("smollm2").path
    base = json.loads((smol / "config.json").read_text())
    config = moe_config(base, family, num_experts, top_k, num_layers, dense_layers)
    hf = load_file(str(smol / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in hf.items():
        parts = name.split(".")
        layer = int(parts[2]) if parts[1] == "layers" else None
        if layer is not None and layer >= num_layers:
            continue
        if layer is None or ".mlp." not in name or layer in dense_layers:
            tensors[name] = tensor
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        if family.startswith("qwen"):
            _attention_extras(tensors, prefix, family, base)
        if layer not in dense_layers:
            _experts(tensors, hf, prefix, family, num_experts, upcycled, generator,
                     base["hidden_size"])
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for file in TOKENIZER_FILES:
        if (smol / file).exists():
            shutil.copy(smol / file, out / file)
    return out


def _attention_extras(tensors: dict, prefix: str, family: str, base: dict) -> None:
    head_dim, attn = base["head_dim"], f"{prefix}self_attn."
    if family == "qwen3_moe":
        tensors[f"{attn}q_norm.weight"] = torch.ones(head_dim)
        tensors[f"{attn}k_norm.weight"] = torch.ones(head_dim)
    else:  # qwen2_moe: q/k/v biases
        for proj in ("q", "k", "v"):
            rows = tensors[f"{attn}{proj}_proj.weight"].shape[0]
            tensors[f"{attn}{proj}_proj.bias"] = torch.zeros(rows)


def _experts(tensors: dict, hf: dict, prefix: str, family: str, num_experts: int,
             upcycled: bool, generator: torch.Generator, hidden: int) -> None:
    block, gate_name, up_name, down_name = EXPERT_NAMES[family]
    mlp = {proj: hf[f"{prefix}mlp.{proj}.weight"] for proj in ("gate_proj", "up_proj",
                                                               "down_proj")}
    for expert in range(num_experts):
        for proj, name in (("gate_proj", gate_name), ("up_proj", up_name),
                           ("down_proj", down_name)):
            weight = mlp[proj].clone()
            if not upcycled:  # each expert its own: rows scaled by up to +-20%
                scale = 1 + 0.2 * (2 * torch.rand(weight.shape[0], 1, generator=generator) - 1)
                weight = weight * scale
            tensors[f"{prefix}{block}.experts.{expert}.{name}.weight"] = weight
    # a random router, large enough that a token's top experts are far from tied
    tensors[f"{prefix}{block}.gate.weight"] = 0.1 * torch.randn(num_experts, hidden,
                                                                generator=generator)
    if family == "qwen2_moe":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"{prefix}mlp.shared_expert.{proj}.weight"] = mlp[proj].clone()
        tensors[f"{prefix}mlp.shared_expert_gate.weight"] = 0.1 * torch.randn(
            1, hidden, generator=generator)
