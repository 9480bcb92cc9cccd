"""docs/flags.md, made from the sections (``python -m cli.flags_doc > docs/flags.md``); a test
fails when the file is stale."""

from __future__ import annotations

import enum
import sys

from cli.serve_flags import SERVICE_CONFIGS, serve_knobs
from shared.config import Knob, knobs_of

HEADER = """# Flags

Every knob of `flotilla serve`, one line each, grouped by the section that declares it
(`shared/sections/`, `cli/serve_flags.py`); made by `python -m cli.flags_doc > docs/flags.md`
from those declarations, so it cannot drift from `flotilla serve --help`. A service run on
its own (`python -m services.<name> --help`) takes the knobs of its own sections, and every
flag also reads from `FLOTILLA_<FLAG>` (e.g. `FLOTILLA_KV_CACHE_MEMORY=2GiB`; a flag beats
the variable, which beats the default). "read by" names the services that take it; knobs the
stack sets per process (replica ids, NATS URL, node ids) are not listed.
"""


def _default(k: Knob) -> str:
    value = k.default.value if isinstance(k.default, enum.Enum) else k.default
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None or value == "" else f"`{value}`"


def _flag(k: Knob) -> str:
    if isinstance(k.default, bool):
        return f"`--{'no-' if k.default else ''}{k.flag[2:]}`"
    return f"`{k.flag}`"


def render() -> str:
    readers = {name: [kind for kind, cls in SERVICE_CONFIGS.items()
                      if any(k.name == name and k.serve for k in knobs_of(cls))]
               for name in (k.name for k in serve_knobs())}
    lines, section = [HEADER], None
    for k in serve_knobs():
        if k.section is not section:
            section = k.section
            doc = " ".join((section.__doc__ or "").split())
            lines += ["", f"## {section.__name__}", ""] + ([doc, ""] if doc else []) + [
                "| flag | default | read by | what |", "| --- | --- | --- | --- |"]
        what = " ".join(k.help.split()).replace("|", "\\|")
        lines.append(f"| {_flag(k)} | {_default(k)} | {', '.join(readers[k.name]) or 'serve'} "
                     f"| {what} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
