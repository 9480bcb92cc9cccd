"""``flotilla bench``: benchmarks to point at flotilla or any OpenAI-compatible server.

Subcommands: ``serve`` (online load over HTTP), ``throughput`` (offline, flotilla vs.
Hugging Face ``generate()``), ``latency`` (fixed batch, per step and per request).
Heavy imports (transformers, torch, matplotlib) wait until a benchmark runs. Its
libraries (httpx, tqdm, matplotlib) are the ``bench`` extra, which serving does not need.
"""

from __future__ import annotations

import argparse
import sys

BENCH_LIBRARIES = ("httpx", "tqdm", "matplotlib")  # pyproject.toml's bench extra
INSTALL_BENCH = "pip install -e '.[bench]' (or `make bench`)"


def add_parser(commands) -> None:
    try:
        from cli.bench import latency, serve, throughput
    except ModuleNotFoundError as exc:
        if exc.name not in BENCH_LIBRARIES:
            raise
        add_missing_extra_parser(commands, exc.name)
        return
    parser = commands.add_parser("bench", help="benchmark flotilla or any OpenAI-compatible server",
                                 description=__doc__.split("\n\n")[0])
    subcommands = parser.add_subparsers(dest="bench_command", required=True)
    serve.add_parser(subcommands)
    throughput.add_parser(subcommands)
    latency.add_parser(subcommands)


def add_missing_extra_parser(commands, missing: str) -> None:
    """``flotilla bench`` without the bench extra: any arguments, and a message that says
    what to install instead of a traceback (``flotilla serve`` keeps working)."""
    parser = commands.add_parser("bench",
                                 help=f"benchmarks (needs the bench extra: {INSTALL_BENCH})")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)

    def missing_extra(_args: argparse.Namespace) -> int:
        print(missing_extra_message(missing), file=sys.stderr)
        return 1

    parser.set_defaults(handler=missing_extra)


def missing_extra_message(missing: str) -> str:
    return f"flotilla bench: {missing} is missing; install the bench extra: {INSTALL_BENCH}"


def run(args: argparse.Namespace) -> int:
    from cli.bench.datasets import DatasetError

    try:
        return args.handler(args)
    except ModuleNotFoundError as exc:  # matplotlib for --plot is imported only then
        if exc.name not in BENCH_LIBRARIES:
            raise
        print(missing_extra_message(exc.name), file=sys.stderr)
        return 1
    except (DatasetError, RuntimeError, TimeoutError) as exc:
        print(f"flotilla bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flotilla bench: interrupted", file=sys.stderr)
        return 130
