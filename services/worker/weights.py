"""Weights for the decoder (model.py): from a Hugging Face directory (``config.json`` +
``*.safetensors``, HF parameter names, q/k/v and gate/up fused at load time), or, for a directory
marked as a dummy model (``shared.models.DUMMY_MARKER``), seeded random weights built on the target
device. With ``quantization="fp8"`` each projection weight is quantized to FP8 as soon as it
exists on the device (one tensor at a time, so the peak stays near the FP8 model's size plus one
projection in the model's dtype); the model's FP8 ``Linear`` modules say which weights those are."""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from kernels.fp8 import FP8_DTYPE, quantize_per_channel
from kernels.rotary import build_cos_sin_cache
from services.worker.fp8_checkpoints import (checkpoint_fp8, per_channel_weights,
                                             pop_checkpoint_kv_scales)
from services.worker.int_checkpoints import PACKED_SUFFIXES, checkpoint_int, dequantized_weights
from services.worker.int_weights import (RTN_LAYOUT, dummy_layout, int_tensors, log_packed,
                                         packed_checkpoint, packing_refusal, quantize_rtn)
from services.worker.model import ModelConfig, Transformer, compute_inv_freq
from services.worker.moe import start_expert_counts
from services.worker.moe_parallel import check_moe_parallel
from services.worker.moe_weights import hub_moe_names, stack_experts
from services.worker.tensor_parallel import TensorParallel
from services.worker.vision import split_checkpoint
from shared.models import DUMMY_MARKER

log = structlog.get_logger()


def load_model(path: Path, device: torch.device, dtype: torch.dtype, seed: int = 0,
               quantization: str = "none", tp: TensorParallel = TensorParallel(),
               batch_invariant: bool = False) -> Transformer:
    """Build the model from a Hugging Face directory without materializing random weights first.

    A dummy-model directory (``DUMMY_MARKER``) gets random weights from ``seed`` instead, made
    directly on ``device`` in ``dtype``. ``quantization``: "none", "fp8" or "int4"
    (``ModelConfig``); a checkpoint of FP8 weights (fp8_checkpoints.py) loads as FP8 either
    way, an integer one (int_checkpoints.py) packed where int_weights.py can keep it so. With
    ``tp``, this rank's part of every weight (tensor_parallel.py): the same weights as one
    rank's, random ones included, split. ``batch_invariant``: its ops so (ModelConfig, ops.py).
    """
    config = dataclasses.replace(ModelConfig.from_path(path), batch_invariant=batch_invariant)
    check_moe_parallel(config.moe, tp.size, tp.expert_parallel)
    refusal = packing_refusal(device, tp.size, config.moe is not None, quantization)
    if quantization == "fp8":
        config = dataclasses.replace(config, quantization=quantization)
    elif quantization == "int4":
        if refusal is not None:
            raise ValueError(f"--quantization int4: {refusal}")
        config = dataclasses.replace(config, quantization="int", int_layout=RTN_LAYOUT)
    unpacked = config
    hf_weights, config = _packed_int_checkpoint(path, config, dtype, refusal)
    packed_by = ("--quantization int4" if config is unpacked else "random weights in the "
                 "config's layout" if (path / DUMMY_MARKER).exists() else "the checkpoint")
    with torch.device("meta"):
        model = Transformer(config, tp)
        whole = Transformer(config) if tp.size > 1 else model  # the names and whole shapes
    model.requires_grad_(False)  # inference only; an FP8 parameter could not require grad
    shard = (lambda name, tensor: tp.shard(name, tensor, config)) if tp.size > 1 else None
    if (path / DUMMY_MARKER).exists():
        state_dict = dict(place(model, draw_random_weights(whole, device, dtype, seed), device,
                                shard))
        log.info("model_random_weights", family=config.family, seed=seed,
                 quantization=config.quantization, tensor_parallel_rank=tp.rank,
                 num_params=sum(t.numel() for t in state_dict.values()))
    elif hf_weights is not None or config.quantization != "none" or tp.size > 1:
        # on the host, each to the device in turn
        if hf_weights is None:
            hf_weights = read_safetensors(path, torch.device("cpu"), dtype, refusal)
        model.checkpoint_kv_scales = pop_checkpoint_kv_scales(hf_weights)
        raw_config = json.loads((path / "config.json").read_text())
        # an integer checkpoint came packed or dequantized: no FP8 scales to take
        checkpoint = None if checkpoint_int(raw_config) else checkpoint_fp8(raw_config)
        if checkpoint is not None:
            hf_weights = per_channel_weights(hf_weights, checkpoint)
        state_dict = dict(place(model, fuse_hf_weights(hf_weights, config), device, shard))
    else:
        hf_weights = read_safetensors(path, device, dtype, refusal)
        model.checkpoint_kv_scales = pop_checkpoint_kv_scales(hf_weights)
        state_dict = fuse_hf_weights(hf_weights, config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.inv_freq = compute_inv_freq(config).to(device)  # the meta-built buffers are empty
    model.cos_sin_cache = build_cos_sin_cache(model.inv_freq, config.max_position_embeddings)
    start_expert_counts(model, device)
    if config.int_layout is not None:
        log_packed(config.int_layout, model, packed_by)
    return model.eval()


def _packed_int_checkpoint(path: Path, config: ModelConfig, dtype: torch.dtype,
                           refusal: str | None
                           ) -> tuple[dict[str, torch.Tensor] | None, ModelConfig]:
    """An integer checkpoint's tensors on the host, its projections packed (int_weights.py),
    and the config saying so; or, when it is not one or ``refusal`` (why not here) is set,
    (None, config) (read_safetensors dequantizes it). Where the layout cannot hold the
    checkpoint, its tensors dequantized and the config unchanged. A dummy model with an
    integer quantization_config: (None, the config with its layout: ``place`` rounds the
    random weights into it)."""
    checkpoint = checkpoint_int(json.loads((path / "config.json").read_text()))
    if checkpoint is None:
        return None, config
    if (path / DUMMY_MARKER).exists():
        layout = refusal or dummy_layout(checkpoint)
        if isinstance(layout, str):
            log.info("dummy_int_weights_unpacked", reason=layout, note="plain random weights")
            return None, config
        return None, dataclasses.replace(config, quantization="int", int_layout=layout)
    if refusal is not None:
        return None, config
    hf_weights = read_safetensors(path, torch.device("cpu"), dtype, int_refusal=None)
    packed = packed_checkpoint(hf_weights, checkpoint, config.num_layers)
    if isinstance(packed, str):  # (why the layout cannot hold it)
        return dequantized_weights(hf_weights, checkpoint, dtype, packed), config
    hf_weights, layout = packed
    return hf_weights, dataclasses.replace(config, quantization="int", int_layout=layout)


def random_weights(model: Transformer, device: torch.device, dtype: torch.dtype, seed: int,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Weights for every parameter of a (meta) model: norms 1, matrices and biases N(0, std).

    std 0.02 keeps the residual stream to tens and the logits near unit scale even for 32 layers
    of hidden 4096, so bf16 stays finite. Each tensor is drawn from its own generator seeded by
    (seed, name), on the target device: the same seed gives the same weights there. An FP8
    model's projection weights are these same tensors, quantized (``place``).
    """
    return dict(place(model, draw_random_weights(model, device, dtype, seed, std), device))


def draw_random_weights(model: Transformer, device: torch.device, dtype: torch.dtype, seed: int,
                        std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """``random_weights``' tensors one at a time, unquantized, in the shapes of ``model`` (a
    packed ``Linear``'s plain weight too: ``place`` quantizes it)."""
    for name, shape in _drawn_shapes(model):
        tensor = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            generator = torch.Generator(device=device)
            generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            tensor.normal_(0.0, std, generator=generator)
        yield name, tensor


def _drawn_shapes(model: Transformer) -> Iterator[tuple[str, torch.Size]]:
    """(name, shape) of every parameter, and of each packed Linear's plain weight."""
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if getattr(module, "int_layout", None) is not None:
            yield f"{prefix}weight", torch.Size((module.out_features, module.in_features))
        for name, param in module.named_parameters(recurse=False):
            yield f"{prefix}{name}", param.shape


def place(model: Transformer, weights: Iterator[tuple[str, torch.Tensor]] | dict,
          device: torch.device, shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each (name, tensor), this rank's part of it when ``shard`` is given (tensor parallel),
    moved to ``device``; the weight of an FP8 ``Linear`` quantized there, with its
    ``weight_scale`` after it, and a packed ``Linear``'s plain weight rounded to its integer
    layout (--quantization int4: ``quantize_rtn``; a checkpoint's come packed). One tensor in
    the model's dtype at a time: a consumer that keeps only what this yields holds the
    quantized model plus one projection."""
    scaled = {name.removesuffix("_scale") for name, _ in model.named_buffers()
              if name.endswith("weight_scale")}
    packed = {name.removesuffix("int_qweight") + "weight" for name, _ in model.named_buffers()
              if name.endswith(".int_qweight")}
    for name, tensor in (weights.items() if isinstance(weights, dict) else weights):
        tensor = (tensor if shard is None else shard(name, tensor)).to(device)
        if name in packed:
            layout = model.config.int_layout
            prefix = name.removesuffix("weight")
            for suffix, part in int_tensors(quantize_rtn(tensor, layout), layout).items():
                yield f"{prefix}{suffix}", part
            continue
        if name in scaled and tensor.dtype != FP8_DTYPE:  # (a checkpoint's FP8 comes scaled)
            tensor, scale = quantize_per_channel(tensor)
            yield f"{name}_scale", scale
        yield name, tensor


def read_safetensors(path: Path, device: torch.device, dtype: torch.dtype,
                     int_refusal: str | None = "on the CPU") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (HF names; Mixtral's MoE names as Qwen's); an integer
    checkpoint's packed projections dequantized to ``dtype`` (int_checkpoints.py), the log
    saying why they are not kept packed (``int_refusal``), or with None kept as they are."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                tensor = f.get_tensor(name)
                # an FP8 checkpoint's weights and scales keep their dtypes (fp8_checkpoints.py)
                # and an integer one's packed tensors and scales theirs (int_checkpoints.py)
                suffix = name.rpartition(".")[2]
                keep = tensor.dtype == FP8_DTYPE or "_scale" in suffix or suffix in PACKED_SUFFIXES
                tensors[name] = tensor.to(device=device, dtype=None if keep else dtype)
    checkpoint = checkpoint_int(json.loads((path / "config.json").read_text()))
    if checkpoint is not None and int_refusal is not None:
        tensors = dequantized_weights(tensors, checkpoint, dtype, int_refusal)
    return hub_moe_names(tensors)


def fuse_hf_weights(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (``model.layers.0.self_attn.q_proj.weight``, ...) -> this module's names
    (an MoE model's experts stacked: moe_weights.py; a vision-language checkpoint's language
    model, its tower left to image_inputs.py: vision.split_checkpoint)."""
    hf = {name.removeprefix("model."): tensor for name, tensor in split_checkpoint(hf).items()}
    if config.moe is not None:
        hf = stack_experts(hf, config)
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    elif "lm_head.weight" not in hf:
        raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    fused = {}
    for name, tensor in hf.items():
        prefix, _, suffix = name.rpartition(".")  # weight, bias, weight_scale or int_*
        if prefix.endswith(("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")):
            continue  # consumed with q_proj / gate_proj
        if prefix.endswith("self_attn.q_proj"):
            base = prefix.removesuffix("q_proj")
            parts = [hf[f"{base}{p}_proj.{suffix}"] for p in ("q", "k", "v")]
            fused[f"{base}qkv_proj.{suffix}"] = _fuse(parts, suffix)
        elif prefix.endswith("mlp.gate_proj"):
            base = prefix.removesuffix("gate_proj")
            parts = [hf[f"{base}gate_proj.{suffix}"], hf[f"{base}up_proj.{suffix}"]]
            fused[f"{base}gate_up_proj.{suffix}"] = _fuse(parts, suffix)
        else:
            fused[name] = tensor
    return fused


def _fuse(parts: list[torch.Tensor], suffix: str) -> torch.Tensor:
    """One fused projection's tensor from its parts': outputs side by side (rows of a plain
    weight, columns of a packed one: kernels/int_pack.py); a packed input order shared."""
    if suffix == "int_perm":
        if any(not torch.equal(part, parts[0]) for part in parts):
            raise ValueError("the fused parts of a packed projection order inputs differently")
        return parts[0]
    return torch.cat(parts, dim=1 if suffix.startswith("int_") else 0)


def check_quantization(path: Path, requested: str, device: torch.device) -> str:
    """The model's quantization, "fp8" when ``requested`` (--quantization) or when the checkpoint
    at ``path`` ships FP8 weights, "int4" when requested, if ``device`` can run it; a clear
    error naming the cause if not (FP8 needs the FP8 tensor cores of compute capability 8.9+,
    int4 a CUDA GPU)."""
    from_checkpoint = ModelConfig.from_path(path).quantization
    if requested == "int4":  # (an integer checkpoint keeps its own layout)
        if from_checkpoint == "fp8":
            raise ValueError(f"--quantization int4: {path.name}'s weights are FP8 "
                             f"(quantization_config in config.json)")
        if device.type != "cuda":
            raise ValueError(f"--quantization int4 needs a CUDA GPU (the packed W4A16 "
                             f"kernels); this worker runs on {device.type}")
        return "int4"
    if "fp8" not in (requested, from_checkpoint):
        return "none"
    require_fp8_device(f"--quantization {requested}" if requested == "fp8" else
                       f"{path.name} (its weights are FP8: quantization_config in config.json)",
                       device)
    return "fp8"


def require_fp8_device(cause: str, device: torch.device) -> None:
    """A clear error naming ``cause`` (a flag, a checkpoint) unless ``device`` has FP8
    support: CUDA, compute capability 8.9+ (Ada, Hopper)."""
    if device.type != "cuda":
        raise ValueError(f"{cause} needs a CUDA GPU with FP8 tensor cores (compute capability "
                         f"8.9+); this worker runs on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"{cause} needs compute capability 8.9+ (FP8 tensor cores); "
                         f"{torch.cuda.get_device_name(device)} has "
                         f"{capability[0]}.{capability[1]}")


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """--device: auto is cuda where there is one, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype: auto is bfloat16 on CUDA, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]
