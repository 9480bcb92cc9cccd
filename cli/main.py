"""The ``flotilla`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from cli import bench
from cli.serve_flags import add_serve_flags, stack_configs, stack_options
from cli.stack import Stack, StackOptions
from shared.config import ConfigError

STOP_MARGIN_S = 10.0  # beyond --shutdown-timeout: the services' own exit after their drain
SUPERVISE_EVERY_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="flotilla LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="run the whole stack: NATS and every service",
        description="Run the whole stack: NATS and every service. Every flag is one knob of "
        "one section (docs/flags.md lists them all); FLOTILLA_<FLAG> variables work too.")
    add_serve_flags(serve)
    bench.add_parser(commands)
    return parser


def serve_options(args: argparse.Namespace) -> StackOptions:
    """The stack ``flotilla serve`` runs, from its flags and FLOTILLA_* variables; a
    ConfigError names the flag of a value a service would refuse."""
    return stack_options(stack_configs(vars(args)), supervise=True)


def serve(args: argparse.Namespace) -> int:
    """Start the stack, restart any child that exits (give up, exit 1, when one keeps
    crashing), and stop it in order on the first Ctrl-C/SIGTERM; the second kills it."""
    try:
        configs = stack_configs(vars(args))
    except ConfigError as exc:
        print(f"flotilla: {exc}", file=sys.stderr, flush=True)
        return 2
    options = stack_options(configs, supervise=True)
    stack = Stack(options)
    shutdown_timeout = options.shutdown_timeout_s
    stopping = threading.Event()
    started = False

    def request_stop(_signum, _frame) -> None:
        # Only os.write and signals here: the main thread may be inside a print or a wait.
        if stopping.is_set():
            os.write(2, b"\nflotilla: stopping at once\n")
            stack.kill()
            return
        stopping.set()
        os.write(2, f"\nflotilla: stopping (up to {shutdown_timeout:g} s for requests in "
                    f"flight; Ctrl-C again to stop at once)\n".encode())
        if not started:
            raise KeyboardInterrupt  # out of stack.start(), which stops what it started

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    model, cache_dir = options.model, options.cache_dir
    print(f"flotilla: starting model {model} (the first start converts it, ~30 s)", flush=True)
    try:
        stack.start()
        started = True
        from shared.models import resolve_model  # cached by now: the services resolved it
        api_key = configs["gateway"].api_key
        name = configs["tokenizer"].served_model_name or resolve_model(model, cache_dir).name
        auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
        print(f"\nflotilla: the OpenAI API is at {stack.base_url}/v1 (model {name!r})\n"
              f"try:\n  curl {stack.base_url}/v1/chat/completions -H 'Content-Type: application/json'"
              f"{auth} \\\n    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"What is the capital of France?\"}}]}}'\n"
              f"Ctrl-C stops everything.", flush=True)
        while not stopping.is_set():
            stack.supervise_once()
            stopping.wait(SUPERVISE_EVERY_S)
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:  # ServiceFailed is a RuntimeError
        print(f"flotilla: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop(timeout_s=shutdown_timeout + STOP_MARGIN_S)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return bench.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
