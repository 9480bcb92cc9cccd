"""Configuration: knobs declared once, in typed sections, and the service configs, command
lines and docs/flags.md made from them.

A knob is one field of a ``Section`` with its help text beside it
(``Annotated[int, knob("...")]``). A service's config is the set of sections it needs,
composed into one flat frozen struct (``compose``), so code reads ``config.max_num_seqs``
and a knob shared by two services (the batch limits: scheduler and worker) is one field of
one section in both. A field ``kv_cache_memory`` is the flag ``--kv-cache-memory`` and the
variable ``FLOTILLA_KV_CACHE_MEMORY``; a flag beats the variable, which beats the default.
``flotilla serve`` builds its parser from every service's sections (cli/serve_flags.py),
builds each service's config in process, so a bad value stops it before any process starts,
and passes the values on as flags (``config_flags``).
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import re
import types
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

import msgspec

C = TypeVar("C", bound="ServiceConfig")

ENV_PREFIX = "FLOTILLA_"


def knob(help: str, *, serve: bool = True) -> msgspec.Meta:  # noqa: A002 (argparse's word)
    """A field's help text. ``serve=False``: the launcher sets it per process (a replica id,
    the NATS URL of the stack it started), so ``flotilla serve`` has no flag for it."""
    return msgspec.Meta(description=help, extra={"serve": serve})


class Section(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of one concern. ``__post_init__`` checks them; ``compose`` runs it for every
    config that includes the section."""


class ServiceConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the composed configs (compose); its subclasses' fields come from sections."""

    __sections__: ClassVar[tuple[type[Section], ...]] = ()

    def with_instance_id(self: C) -> C:
        """This config with a generated instance id, if it has the knob and it is empty."""
        if "instance_id" not in self.__struct_fields__ or self.instance_id:
            return self
        return msgspec.structs.replace(self, instance_id=uuid.uuid4().hex[:8])

    def section(self, section_cls: type[Section]) -> Any:
        """This config's values of one of its sections, as that section's struct."""
        return section_cls(**{name: getattr(self, name) for name in section_cls.__struct_fields__})


@dataclass(frozen=True)
class Knob:
    name: str
    annotation: Any  # the field's type, Annotated stripped
    default: Any
    help: str
    serve: bool
    section: type[Section]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def section_knobs(section_cls: type[Section]) -> list[Knob]:
    hints = get_type_hints(section_cls, include_extras=True)
    out = []
    for field in msgspec.structs.fields(section_cls):
        annotation, meta = hints[field.name], None
        if get_origin(annotation) is Annotated:
            annotation, *extras = get_args(annotation)
            meta = next((extra for extra in extras if isinstance(extra, msgspec.Meta)), None)
        if meta is None or not meta.description:
            raise TypeError(f"{section_cls.__name__}.{field.name} has no help: declare it "
                            f"as Annotated[type, knob('...')]")
        default = field.default if field.default is not msgspec.NODEFAULT \
            else field.default_factory()
        out.append(Knob(field.name, annotation, default, meta.description,
                        (meta.extra or {}).get("serve", True), section_cls))
    return out


def knobs_of(config_cls: type) -> list[Knob]:
    """Every knob of a composed config (or of one section), in declaration order."""
    sections = getattr(config_cls, "__sections__", None) or (config_cls,)
    return [k for section in sections for k in section_knobs(section)]


def compose(name: str, doc: str, sections: Sequence[type[Section]], *, module: str,
            checks: Iterable[Callable[[Any], None]] = ()) -> type:
    """A service config: one frozen struct with every field of ``sections`` (a name in two
    of them is an error), whose construction runs each section's checks, then ``checks``
    (across sections). Sections' methods and properties carry over."""
    fields, seen, namespace = [], {}, {}
    for section in sections:
        hints = get_type_hints(section, include_extras=True)
        for field in msgspec.structs.fields(section):
            if field.name in seen:
                raise TypeError(f"{name}: {field.name} is in {seen[field.name].__name__} "
                                f"and {section.__name__}")
            seen[field.name] = section
            default = (field.default if field.default is not msgspec.NODEFAULT
                       else msgspec.field(default_factory=field.default_factory))
            fields.append((field.name, hints[field.name], default))
        for attr, value in vars(section).items():
            if not attr.startswith("__") and isinstance(value, (property, types.FunctionType)):
                namespace[attr] = value
    cross_checks = tuple(checks)

    def __post_init__(self) -> None:
        for section in sections:
            self.section(section)  # its __post_init__ checks it
        for check in cross_checks:
            check(self)

    namespace.update(__doc__=doc, __post_init__=__post_init__, __sections__=tuple(sections))
    return msgspec.defstruct(name, fields, bases=(ServiceConfig,), module=module,
                             namespace=namespace, frozen=True, kw_only=True)


# ---------------------------------------------------------------- values from text
def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _optional_of(annotation: Any) -> Any:
    """T for ``T | None``, else the annotation itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_choice(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.StrEnum)


def _is_struct(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, msgspec.Struct)


def check_choice(value: str, choices: type[enum.StrEnum], name: str) -> None:
    """A ValueError naming the choices unless ``value`` is one of them: a config built in
    code (not from text, which is converted) can hold any string."""
    if value not in set(choices):
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def check_number(value: float, name: str, *, minimum: float = 0.0) -> None:
    """A ValueError unless ``value`` is a real number >= ``minimum`` (nan is not)."""
    if not (isinstance(value, (int, float)) and not math.isnan(value) and value >= minimum):
        raise ValueError(f"{name} must be a number, {minimum:g} or more, not {value!r}")


def coerce(text: Any, annotation: Any, name: str) -> Any:
    """A knob's value from its flag's or variable's text (values already typed pass)."""
    if not isinstance(text, str):
        return text
    inner = _optional_of(annotation)
    if inner is not annotation and text.strip().lower() in ("", "none"):
        return None
    try:
        if inner is bool:
            return _parse_bool(text)
        if _is_choice(inner):
            check_choice(text, inner, name)
        if _is_struct(inner):
            return msgspec.json.decode(text.encode(), type=inner)
        return msgspec.convert(text, inner, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid value for {flag_of(name)}: {text!r} ({exc})") from None
    except msgspec.DecodeError as exc:  # (a ValueError too)
        raise ValueError(f"{flag_of(name)} is not JSON: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"invalid value for {flag_of(name)}: {text!r} ({exc})") from None


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------- parsers and configs
def add_knobs(parser, knobs: Iterable[Knob], *, with_env: bool = True) -> None:
    """One argument per knob (a parser or an argument group); every default is None, so a
    caller can tell a given flag from a default."""
    for k in knobs:
        annotation = _optional_of(k.annotation)
        shown = k.default.value if isinstance(k.default, enum.Enum) else k.default
        shown = ("on" if shown else "off") if annotation is bool else repr(shown)
        text = f"{k.help} (default {shown}{f'; env {k.env}' if with_env else ''})"
        if annotation is bool:
            parser.add_argument(k.flag, dest=k.name, action=argparse.BooleanOptionalAction,
                                default=None, help=text)
        elif _is_choice(annotation):
            parser.add_argument(k.flag, dest=k.name, default=None, help=text,
                                choices=[str(member) for member in annotation])
        else:
            parser.add_argument(k.flag, dest=k.name, default=None, help=text,
                                metavar="JSON" if _is_struct(annotation) else None)


def build_parser(config_cls: type, prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=config_cls.__doc__)
    add_knobs(parser, knobs_of(config_cls))
    return parser


class ConfigError(ValueError):
    """A value a config refused, said with the flag's name."""


def build_config(config_cls: type[C], values: Mapping[str, Any],
                 environ: Mapping[str, str] | None = None) -> C:
    """``config_cls`` from ``values`` (text or typed, by field name; None: not given), then
    ``FLOTILLA_*`` variables, then defaults. A ConfigError names the flag of a bad value."""
    environ = {} if environ is None else environ
    given: dict[str, Any] = {}
    names = []
    for k in knobs_of(config_cls):
        names.append(k.name)
        raw = values.get(k.name)
        if raw is None:
            raw = environ.get(k.env)
        if raw is not None:
            try:
                given[k.name] = coerce(raw, k.annotation, k.name)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
    try:
        return config_cls(**given).with_instance_id()
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        raise ConfigError(_with_flag_names(str(exc), names)) from None


def _with_flag_names(message: str, names: Iterable[str]) -> str:
    """A check's message with its field names as the flags a user types."""
    for name in sorted(names, key=len, reverse=True):
        message = re.sub(rf"(?<![-\w]){name}\b", flag_of(name), message)
    return message


def load_config(config_cls: type[C], argv: Sequence[str] | None = None,
                environ: Mapping[str, str] | None = None) -> C:
    """A service's config from its command line and the environment; exits on a bad value."""
    environ = os.environ if environ is None else environ
    args = build_parser(config_cls).parse_args(argv)
    try:
        return build_config(config_cls, vars(args), environ)
    except ConfigError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from exc


def config_flags(config: ServiceConfig, *, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that rebuild ``config`` in a child process: one for each knob whose value
    is not its default, less the knobs the launcher sets per process and ``exclude``."""
    out: list[str] = []
    excluded = set(exclude)
    for k in knobs_of(type(config)):
        value = getattr(config, k.name)
        if not k.serve or k.name in excluded or value == k.default or value is None:
            continue
        if isinstance(value, bool):
            out.append(k.flag if value else "--no-" + k.flag[2:])
        elif isinstance(value, msgspec.Struct):
            out += [k.flag, _struct_json(value)]
        else:
            out += [k.flag, str(value)]
    return out


def _struct_json(value: msgspec.Struct) -> str:
    """JSON of a struct's fields that are not their defaults (what a user would write)."""
    defaults = type(value)()
    given = {name: getattr(value, name) for name in value.__struct_fields__
             if getattr(value, name) != getattr(defaults, name)}
    return msgspec.json.encode(given).decode()


# ---------------------------------------------------------------- sizes
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
