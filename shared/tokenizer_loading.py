"""Load a model directory's Hugging Face tokenizer without AutoTokenizer's start-up bill.

``AutoTokenizer.from_pretrained`` picks the tokenizer class from the model's config, and
transformers 5 builds that config by importing the model's configuration module, which
imports torch and the model-loading machinery (``torch.distributed.tensor`` among it): on
the 2-core machine that was 9-14 s of a tokenizer's or a gateway's restart, for a tokenizer
that loads in ~0.5 s. The class AutoTokenizer picks depends only on the directory's files
and the transformers version, so the first load writes the class down (one small JSON file
under ``<cache_dir>/tokenizer-classes/``, keyed by those) and every later load calls that
class's ``from_pretrained`` directly, as AutoTokenizer itself ends by doing. Only
transformers' own classes are written down (a repository's remote code always goes through
AutoTokenizer), and a record that no longer loads falls back to AutoTokenizer.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import time
from pathlib import Path

import structlog

log = structlog.get_logger()

DEFAULT_CACHE_DIR = "~/.cache/flotilla"
RECORD_VERSION = "1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def load_tokenizer(model_dir: str | Path, cache_dir: str | Path = DEFAULT_CACHE_DIR):
    """The tokenizer AutoTokenizer would load from ``model_dir``, by its recorded class when
    an earlier load recorded it."""
    model_dir = Path(model_dir).resolve()
    record = record_path(model_dir, cache_dir)
    started = time.perf_counter()
    tokenizer_class = _recorded_class(record)
    if tokenizer_class is not None:
        try:
            tokenizer = tokenizer_class.from_pretrained(str(model_dir), _from_auto=True)
        except Exception as exc:  # noqa: BLE001 - AutoTokenizer below says what is wrong
            log.warning("tokenizer_record_unusable", record=str(record), error=repr(exc))
        else:
            log.info("tokenizer_loaded", path="recorded class", cls=tokenizer_class.__name__,
                     seconds=round(time.perf_counter() - started, 2))
            return tokenizer
    from transformers import AutoTokenizer  # (imports torch and the model's config module)

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    _remember(record, type(tokenizer))
    log.info("tokenizer_loaded", path="AutoTokenizer", cls=type(tokenizer).__name__,
             seconds=round(time.perf_counter() - started, 2))
    return tokenizer


def record_path(model_dir: Path, cache_dir: str | Path) -> Path:
    """Where the class for this directory's files under this transformers is written down:
    a new transformers, or any file of the directory changed, gives a new name."""
    digest = hashlib.sha256(f"{RECORD_VERSION}|{importlib.metadata.version('transformers')}|"
                            f"{model_dir}".encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"|{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return (Path(cache_dir).expanduser() / "tokenizer-classes"
            / f"{digest.hexdigest()[:16]}.json")


def _recorded_class(record: Path) -> type | None:
    try:
        entry = json.loads(record.read_text())
        module_name, class_name = entry["module"], entry["class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not module_name.startswith("transformers."):
        return None
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return None


def _remember(record: Path, tokenizer_class: type) -> None:
    if not tokenizer_class.__module__.startswith("transformers."):
        return  # remote code: AutoTokenizer decides each time
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        staging = record.with_suffix(f".{id(record)}.tmp")
        staging.write_text(json.dumps({"module": tokenizer_class.__module__,
                                       "class": tokenizer_class.__qualname__}))
        staging.replace(record)  # (atomic: a reader never sees half a file)
    except OSError as exc:  # a read-only cache only costs the next start its time
        log.warning("tokenizer_record_not_written", record=str(record), error=repr(exc))
