"""``flotilla bench``: benchmarks to point at flotilla or any OpenAI-compatible server.

Subcommands: ``serve`` (online load over HTTP), ``throughput`` (offline, flotilla vs.
Hugging Face ``generate()``), ``latency`` (fixed batch, per step and per request).
Heavy imports (transformers, torch, matplotlib) wait until a benchmark runs.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(commands) -> None:
    from cli.bench import latency, serve, throughput

    parser = commands.add_parser("bench", help="benchmark flotilla or any OpenAI-compatible server",
                                 description=__doc__.split("\n\n")[0])
    subcommands = parser.add_subparsers(dest="bench_command", required=True)
    serve.add_parser(subcommands)
    throughput.add_parser(subcommands)
    latency.add_parser(subcommands)


def run(args: argparse.Namespace) -> int:
    from cli.bench.datasets import DatasetError

    try:
        return args.handler(args)
    except (DatasetError, RuntimeError, TimeoutError) as exc:
        print(f"flotilla bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flotilla bench: interrupted", file=sys.stderr)
        return 130
