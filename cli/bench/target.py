"""What a benchmark runs against: the server (a given URL, or a flotilla stack it starts
and stops), the model name requests carry, and the tokenizer that builds prompts."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from cli.bench.datasets import DatasetError
from shared.models import ModelFiles, resolve_model

DEFAULT_MODEL = "smollm2"


def local_model(spec: str) -> ModelFiles | None:
    """The model's local files if ``spec`` names one flotilla can load, else None (it may
    still be a name some other server serves)."""
    try:
        return resolve_model(spec)
    except ValueError:
        return None


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"could not list the models at {base_url}/v1/models ({exc}); "
                           "pass --model") from None


def model_spec(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.base_url:
        return served_model(args.base_url, args.api_key)
    return DEFAULT_MODEL


def request_model_name(spec: str) -> str:
    files = local_model(spec)
    return files.name if files is not None else spec


def load_tokenizer(tokenizer_spec: str | None, spec: str):
    from transformers import AutoTokenizer  # heavy: only when a benchmark runs

    source = tokenizer_spec or spec
    files = local_model(source)
    try:
        return AutoTokenizer.from_pretrained(str(files.path) if files else source,
                                             local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"no local tokenizer for {source!r} ({exc}); "
                           "pass --tokenizer DIR") from None




@contextmanager
def server(args: argparse.Namespace, spec: str) -> Iterator[str]:
    """Yield the base URL: --base-url if given, else that of a flotilla stack started here
    on a free port (logs in a temporary folder) and stopped afterwards."""
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    from cli.serve_flags import stack_configs, stack_options
    from cli.stack import Stack, free_port

    log_dir = Path(tempfile.mkdtemp(prefix="flotilla-bench-"))
    engine = {name: getattr(args, name, None) for name in args.engine_knobs}
    configs = stack_configs({**engine, "model": spec, "host": "127.0.0.1", "port": free_port(),
                             "log_dir": str(log_dir)})
    stack = Stack(stack_options(configs, supervise=False))
    print(f"flotilla bench: starting a flotilla stack for {spec} (logs in {log_dir})",
          file=sys.stderr, flush=True)
    stack.start()
    try:
        yield stack.base_url
    finally:
        stack.stop()
