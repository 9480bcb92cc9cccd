"""LoRA adapters in the PEFT format, checked from their files alone (no tensors read): the
rules every service applies, pure of torch.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` with, per layer i and target t,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{t}.lora_A.weight`` [r, in_features] and
``...lora_B.weight`` [out_features, r]. ``inspect_adapter`` checks an adapter whole against
the base model's projection shapes (``BaseShapes``, which the worker computes from its model
and announces) reading only the safetensors header; the scheduler does so when an adapter
is loaded at run time, and the worker (services/worker/lora.py) applies the same checks to
the tensors it loads. ``LoraRef`` is an adapter's identity on the wire: its name, its
directory and a hash of its two files, so a reloaded adapter with new weights never shares
prefix-cache blocks with the old one (docs/lora.md).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from msgspec import Struct

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj"})
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT options that change the math in ways flotilla does not compute: refused by name
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "layer_replication": None}
CONFIG_FILE, TENSORS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoraRef(Struct, frozen=True, kw_only=True):
    """A registered adapter: what a request names (``name``), where its files are, the
    hash of their bytes (its version) and its rank."""

    name: str
    path: str
    content_hash: str
    rank: int = 0

    @property
    def cache_key(self) -> str:
        """Its part of the prefix-cache key (shared/prefix_hash.py)."""
        return f"{self.name}:{self.content_hash}"


class BaseShapes(Struct, frozen=True, kw_only=True):
    """What an adapter must fit: the base model's layer count, each PEFT part the model
    computes LoRA for -> [out_features, in_features] (a Mixture-of-Experts model has no
    MLP parts), and the largest rank a slot holds."""

    num_layers: int
    part_shapes: dict[str, list[int]]
    max_rank: int


class AdapterSettings(Struct, frozen=True, kw_only=True):
    rank: int
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # PEFT part names, in TARGETS order


# ---- the run-time load and unload (gateway -> each scheduler), on the wire
class LoraLoadRequest(Struct, frozen=True, kw_only=True):
    """gateway -> each scheduler: register a PEFT adapter at run time (vLLM's
    /v1/load_lora_adapter); ``replace``: a name registered already takes the new files."""

    lora_name: str
    lora_path: str
    replace: bool = False


class LoraUnloadRequest(Struct, frozen=True, kw_only=True):
    lora_name: str


class LoraReply(Struct, frozen=True, kw_only=True):
    """A scheduler's adapters after a load or unload, at ``timestamp`` (its wall clock,
    as its stats events', so a gateway keeps whichever of the two is newer)."""

    adapters: list[LoraRef] = []
    timestamp: float = 0.0


def tensor_name(layer: int, part: str, matrix: str) -> str:
    """PEFT's saved name of one matrix (``matrix``: lora_A or lora_B)."""
    return f"base_model.model.model.layers.{layer}.{_PARENT[part]}.{part}.{matrix}.weight"


def where_of(name: str, path: str | Path) -> str:
    return f"LoRA adapter {name!r} ({path})"


def read_settings(path: Path, where: str, base: BaseShapes) -> AdapterSettings:
    """adapter_config.json's rank, scaling and targets, checked against ``base``; a
    ValueError names the field."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    try:
        settings = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {settings['peft_type']!r} is not LORA")
    for field, plain in _UNSUPPORTED.items():
        value = settings.get(field, plain)
        if value != plain and value not in (None, [], {}):
            raise ValueError(f"{where}: {field}={value!r} is not supported")
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, not {rank!r}")
    if rank > base.max_rank:
        raise ValueError(f"{where}: rank r={rank} is above max_lora_rank {base.max_rank}")
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, not {alpha!r}")
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    targets = _targets(settings.get("target_modules"), base, where)
    return AdapterSettings(rank=rank, scaling=float(scaling), target_modules=targets)


def _targets(value, base: BaseShapes, where: str) -> tuple[str, ...]:
    """PEFT's target_modules (a list, or one name) -> the parts, in TARGETS order."""
    names = [value] if isinstance(value, str) else list(value or [])
    if not names:
        raise ValueError(f"{where}: target_modules is empty")
    for module in names:
        if module not in TARGETS:
            raise ValueError(f"{where}: target module {module!r} is not supported (LoRA "
                             f"targets only {', '.join(TARGETS)})")
        if module not in base.part_shapes:  # (MLP parts of a Mixture-of-Experts model)
            raise ValueError(f"{where}: MLP targets on a Mixture-of-Experts model are not "
                             f"supported (target the attention projections)")
    return tuple(part for part in TARGETS if part in names)


def check_tensor_shapes(shapes: dict[str, tuple[int, ...]], settings: AdapterSettings,
                        base: BaseShapes, where: str) -> None:
    """Every target of every layer present with the base's shapes, nothing else there."""
    expected = set()
    for layer in range(base.num_layers):
        for part in settings.target_modules:
            out_features, in_features = base.part_shapes[part]
            for matrix, shape in (("lora_A", (settings.rank, in_features)),
                                  ("lora_B", (out_features, settings.rank))):
                key = tensor_name(layer, part, matrix)
                expected.add(key)
                if key not in shapes:
                    raise ValueError(f"{where}: tensor {key} is missing")
                if tuple(shapes[key]) != shape:
                    raise ValueError(f"{where}: tensor {key} has shape {list(shapes[key])}, "
                                     f"the base model's {part} needs {list(shape)}")
    extra = sorted(set(shapes) - expected)
    if extra:
        raise ValueError(f"{where}: tensor {extra[0]} is not a LoRA matrix of a target "
                         f"flotilla computes ({len(extra)} such)")


def header_shapes(path: Path, where: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in adapter_model.safetensors, from its header alone."""
    from safetensors import safe_open  # (numpy only: no framework is loaded)

    tensors_path = path / TENSORS_FILE
    if not tensors_path.is_file():
        raise ValueError(f"{where}: no {TENSORS_FILE}")
    try:
        with safe_open(str(tensors_path), framework="numpy") as tensors:
            return {key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
        raise ValueError(f"{where}: {TENSORS_FILE} is not a safetensors file ({exc})") from None


def content_hash(path: str | Path) -> str:
    """SHA-256 (hex, 16 digits) over the adapter's config and tensor files' bytes."""
    digest = hashlib.sha256()
    for file_name in (CONFIG_FILE, TENSORS_FILE):
        try:
            with open(Path(path) / file_name, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
        except OSError:
            digest.update(b"missing:" + file_name.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def inspect_adapter(name: str, path: str | Path, base: BaseShapes) -> LoraRef:
    """The adapter in PEFT directory ``path`` checked whole against ``base`` from its files
    (no tensors read); a ValueError names the adapter and what is wrong."""
    path = Path(path)
    where = where_of(name, path)
    if not path.is_dir():
        raise ValueError(f"{where}: no such directory")
    settings = read_settings(path, where, base)
    check_tensor_shapes(header_shapes(path, where), settings, base, where)
    return LoraRef(name=name, path=str(path), content_hash=content_hash(path),
                   rank=settings.rank)
