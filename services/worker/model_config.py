"""What a model is, read once from its config.json: ``ModelConfig`` (the decoder's shape and
switches, Mixture-of-Experts blocks included), and the rotary frequencies it implies.

The families differ only in a few switches: biases on q/k/v (Qwen2) or on all projections (Llama
``attention_bias``), per-head RMSNorm of q and k before rotary (Qwen3), an explicit ``head_dim``,
a sliding window (Mistral v0.1; not implemented: it caps the usable context), and sparse MLP
blocks (Mixtral, Qwen2-MoE, Qwen3-MoE: ``MoeSpec``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from kernels.int_pack import IntLayout
from services.worker.fp8_checkpoints import checkpoint_fp8
from services.worker.int_checkpoints import checkpoint_int
from services.worker.vision import text_config_of

log = structlog.get_logger()


# architectures[0] in config.json (or, when that is empty, model_type) -> family
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}
QWEN2_FAMILIES, QWEN3_FAMILIES = ("qwen2", "qwen2_moe"), ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class MoeSpec:
    """A model's sparse MLP blocks: each token's ``top_k`` of ``num_experts`` SwiGLU experts of
    ``intermediate_size``, their outputs summed by the router's softmax weights (renormalized
    over the k chosen where ``renormalize``), in the layers ``sparse_layers`` (the others are
    dense MLPs of ModelConfig.intermediate_size). Qwen2-MoE adds a shared expert of
    ``shared_expert_intermediate_size`` to every token, scaled by a sigmoid gate."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0
    # expert parallelism (moe_parallel.py): this rank's experts, from first_local_expert on
    first_local_expert: int = 0
    num_local_experts: int = 0  # 0: every expert

    @property
    def local_experts(self) -> int:
        """The experts this rank holds (the router still scores all num_experts)."""
        return self.num_local_experts or self.num_experts

    @classmethod
    def from_dict(cls, config: dict, family: str) -> MoeSpec | None:
        if family == "mixtral":
            num_experts, inter = config["num_local_experts"], config["intermediate_size"]
            renormalize, sparse = True, tuple(range(config["num_hidden_layers"]))
        elif family in ("qwen2_moe", "qwen3_moe"):
            num_experts, inter = config["num_experts"], config["moe_intermediate_size"]
            renormalize = config.get("norm_topk_prob", False)
            step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers")
                                                                     or ())
            sparse = tuple(i for i in range(config["num_hidden_layers"])
                           if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        else:
            return None
        top_k = config["num_experts_per_tok"]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the number of "
                             f"experts ({num_experts}) in config.json")
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=inter,
                   renormalize=renormalize, sparse_layers=sparse,
                   shared_expert_intermediate_size=config.get(
                       "shared_expert_intermediate_size", 0) if family == "qwen2_moe" else 0)


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
    # --quantization fp8's; "int": they stay packed integers on the GPU, as ``int_layout``
    # says (an integer checkpoint's own, or --quantization int4's: int_weights.py); "none":
    # all in the model's dtype (an integer checkpoint dequantized at load included)
    quantization: str = "none"
    int_layout: IntLayout | None = None  # with "int": the packed projections' layout
    batch_invariant: bool = False  # --batch-invariant (ops.py), passed by each layer to its ops
    moe: MoeSpec | None = None  # sparse MLP blocks (None: a dense model)

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        """A vision-language config.json gives its language model's (vision.py)."""
        config = text_config_of(config)
        family = _family(config)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only silu)")
        num_heads = config["num_attention_heads"]
        # Llama's attention_bias covers all four projections; Qwen2 always has q/k/v biases only;
        # Mistral has none. Only Llama has mlp_bias.
        attention_bias = (config.get("attention_bias", False)
                          and family in ("llama", *QWEN3_FAMILIES))
        default_head_dim = (128 if family in QWEN3_FAMILIES
                            else config["hidden_size"] // num_heads)
        model_config = cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_heads=num_heads, num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or default_head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_parameters=_rope_parameters(config),
            max_position_embeddings=config.get("max_position_embeddings", 2048), family=family,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=attention_bias or family in QWEN2_FAMILIES, o_proj_bias=attention_bias,
            mlp_bias=family == "llama" and config.get("mlp_bias", False),
            qk_norm=family in QWEN3_FAMILIES, sliding_window=_sliding_window(config, family),
            # an integer checkpoint: "none" until weights.load_model keeps it packed (a GPU)
            quantization=("fp8" if checkpoint_int(config) is None and checkpoint_fp8(config)
                          else "none"),
            moe=MoeSpec.from_dict(config, family))
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

    Mistral and Mixtral slide in every layer when ``sliding_window`` is set (v0.1: 4096); Qwen2/3
    (and their MoE models) only with
    ``use_sliding_window``, in the layers ``layer_types`` (or ``max_window_layers``) name; Llama
    never (transformers ignores the key too).
    """
    window = config.get("sliding_window")
    if not window or family == "llama":
        return None
    if family in (*QWEN2_FAMILIES, *QWEN3_FAMILIES):
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


