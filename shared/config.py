"""Service configuration: one frozen struct per service, built once from command-line
flags and ``FLOTILLA_*`` environment variables, then passed down.

A field ``kv_cache_memory`` becomes the flag ``--kv-cache-memory`` and the variable
``FLOTILLA_KV_CACHE_MEMORY``; a flag beats the variable, which beats the default.
Help text for a service's own fields comes from its class-level ``__help__`` dict.
"""

from __future__ import annotations

import argparse
import enum
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar, get_type_hints

import msgspec

C = TypeVar("C", bound="ServiceConfig")

ENV_PREFIX = "FLOTILLA_"


class OtelExporter(enum.StrEnum):
    """Where each service's OpenTelemetry spans go (shared/tracing.py)."""

    NONE = "none"  # no spans; the trace context is passed through
    CONSOLE = "console"


class ServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Fields every service has."""

    nats_url: str = "nats://127.0.0.1:4222"
    namespace: str = "flotilla"  # subject prefix; two deployments can share one NATS
    model: str = "smollm2"
    log_level: str = "info"
    log_json: bool = False
    otel_exporter: OtelExporter = OtelExporter.NONE
    instance_id: str = ""  # unique per process; generated when empty
    cache_dir: str = "~/.cache/flotilla"  # converted models live here

    __help__: ClassVar[Mapping[str, str]] = {}

    def with_instance_id(self: C) -> C:
        if self.instance_id:
            return self
        return msgspec.structs.replace(self, instance_id=uuid.uuid4().hex[:8])


_COMMON_HELP = {
    "nats_url": "NATS server URL",
    "namespace": "subject prefix, so several deployments can share one NATS",
    "model": "model: 'smollm2' (default), a .gguf file, or a Hugging Face model directory",
    "log_level": "debug, info, warning or error",
    "log_json": "log JSON lines instead of console text",
    "otel_exporter": "OpenTelemetry span exporter: none or console",
    "instance_id": "unique id of this process (generated when empty)",
    "cache_dir": "where converted models are cached",
}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def build_parser(config_cls: type[ServiceConfig], prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=config_cls.__doc__)
    hints = get_type_hints(config_cls)
    help_texts = {**_COMMON_HELP, **getattr(config_cls, "__help__", {})}
    for field in msgspec.structs.fields(config_cls):
        if field.name.startswith("_"):
            continue
        flag = "--" + field.name.replace("_", "-")
        text = help_texts.get(field.name, "")
        env = ENV_PREFIX + field.name.upper()
        if hints[field.name] is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=None, help=f"{text} (env {env})")
        elif _is_choice(hints[field.name]):
            parser.add_argument(flag, dest=field.name, default=None,
                                choices=[str(member) for member in hints[field.name]],
                                help=f"{text} (env {env}, default {str(field.default)!r})")
        else:
            parser.add_argument(flag, dest=field.name, default=None,
                                help=f"{text} (env {env}, default {field.default!r})")
    return parser


def load_config(config_cls: type[C], argv: Sequence[str] | None = None,
                environ: Mapping[str, str] | None = None) -> C:
    """Build ``config_cls`` from flags, then ``FLOTILLA_*`` variables, then defaults."""
    environ = os.environ if environ is None else environ
    args = build_parser(config_cls).parse_args(argv)
    values: dict[str, Any] = {}
    hints = get_type_hints(config_cls)
    for field in msgspec.structs.fields(config_cls):
        raw = getattr(args, field.name, None)
        if raw is None:
            raw = environ.get(ENV_PREFIX + field.name.upper())
        if raw is None:
            continue
        values[field.name] = _coerce(raw, hints[field.name], field.name)
    try:
        return config_cls(**values).with_instance_id()
    except (ValueError, msgspec.ValidationError) as exc:
        raise SystemExit(f"invalid configuration: {exc}") from exc


def _is_choice(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.StrEnum)


def check_choice(value: str, choices: type[enum.StrEnum], name: str) -> None:
    """A ValueError naming the choices unless ``value`` is one of them: a config built in
    code (not by load_config, which converts the text) can hold any string."""
    if value not in set(choices):
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def _coerce(raw: Any, annotation: Any, name: str) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        if annotation is bool:
            return _parse_bool(raw)
        if _is_choice(annotation):
            check_choice(raw, annotation, name)
        return msgspec.convert(raw, annotation, strict=False)
    except (ValueError, msgspec.ValidationError) as exc:
        raise SystemExit(f"invalid value for {name}: {raw!r} ({exc})") from exc


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "KI": 1024,
          "M": 1000**2, "MB": 1000**2, "MIB": 1024**2, "MI": 1024**2,
          "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "GI": 1024**3,
          "T": 1000**4, "TB": 1000**4, "TIB": 1024**4, "TI": 1024**4}


def parse_size(text: str | int) -> int:
    """'1GiB' -> 1073741824, '512MB' -> 512000000, '1000' -> 1000."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes or e.g. 2GiB, 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").upper()])
