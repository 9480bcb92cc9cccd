"""The ``flotilla`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from cli import bench
from cli.engine_flags import (
    add_engine_flags, engine_flag_error, engine_service_args, gpus_per_replica,
    tensor_parallel_size_of,
)
from cli.stack import Stack, StackOptions, flags
from services.gateway.config import RoutingPolicy
from services.scheduler.config import SchedulingPolicy
from services.scheduler.speculation import worker_speculation

STOP_MARGIN_S = 10.0  # beyond --shutdown-timeout: the services' own exit after their drain
SUPERVISE_EVERY_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description="flotilla LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the whole stack: NATS and every service")
    serve.add_argument("--model", default="smollm2",
                       help="'smollm2' (default), a .gguf file or a Hugging Face model directory")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in the API: /v1/models lists it and requests "
                       "must use it (default: the model's own name, e.g. SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="0.0.0.0", help="address the API listens on")
    serve.add_argument("--port", type=int, default=8000, help="API port")
    serve.add_argument("--nats-url", default=None,
                       help="use this NATS server instead of starting one")
    serve.add_argument("--namespace", default="flotilla", help="NATS subject prefix")
    serve.add_argument("--api-key", default=None, help="require this bearer token")
    serve.add_argument("--replicas", type=int, default=1,
                       help="scheduler+worker pairs; the gateway routes between them (--routing)")
    serve.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                       help="gateway processes sharing --port (SO_REUSEPORT; each its own NATS "
                       "client and streams): more streams' chunks written per second "
                       "(docs/deploy.md). Default 1")
    serve.add_argument("--routing", default=None, choices=list(RoutingPolicy),
                       help="which replica gets a request: kv (default: where its prefix is "
                       "cached, priced against load), least-loaded or round-robin "
                       "(docs/routing.md)")
    add_engine_flags(serve)
    serve.add_argument("--no-prefix-caching", action="store_true",
                       help="turn off automatic prefix caching")
    serve.add_argument("--no-admission-reserve", action="store_true",
                       help="admit requests into the last free KV blocks, without room for the "
                       "running ones to grow (more preemptions: docs/bench.md)")
    serve.add_argument("--scheduling-policy", default=None, choices=list(SchedulingPolicy))
    serve.add_argument("--chunk-step-ratio", default=None,
                       help="cap prompt chunks so a step that also decodes takes at most this "
                       "many decode-only steps' time (default 0: off)")
    serve.add_argument("--max-decode-stall-ms", default=None,
                       help="cap prompt chunks so a step that also decodes takes at most this "
                       "long: the longest gap between a stream's tokens while prompts are "
                       "admitted; it costs time to first token (0: off; default 300 with "
                       "a GPU worker, off on a CPU; docs/bench.md)")
    serve.add_argument("--max-steps-in-flight", default=None,
                       help="steps each scheduler sends ahead to its worker (default 2)")
    serve.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="speculative decoding, vLLM's fields: '{\"method\": \"ngram\", "
                       "\"num_speculative_tokens\": 4}' (prompt lookup; greedy requests keep "
                       "their text, sampled ones their distribution; "
                       "docs/speculative-decoding.md)")
    kv = serve.add_argument_group("kvstore", "the node's KV tiers below the worker's cache "
                                  "(docs/kvstore.md)")
    kv.add_argument("--no-kvstore", action="store_true",
                    help="run without the kvstore (no host-RAM or disk tier)")
    kv.add_argument("--kv-host-memory", default=None,
                    help="host-RAM tier size, e.g. 8GiB (default 4GiB; shared memory, taken "
                    "as it fills)")
    kv.add_argument("--kv-disk-dir", default=None,
                    help="directory of the disk tier (default: no disk tier)")
    kv.add_argument("--kv-disk-size", default=None, help="disk tier size (default 16GiB)")
    kv.add_argument("--kv-node-id", default="local",
                    help="this node's kvstore id (workers and schedulers use it)")
    kv.add_argument("--kv-load-layer-groups", default=None,
                    help="CUDA workers copy each load from the kvstore in this many layer "
                    "groups, so a forward's first layers run while later ones still load "
                    "(default 8: a 16k-token host hit's TTFT 57 ms on an H200, against 59 ms "
                    "with 4 and 76 ms with 1, the whole load first)")
    serve.add_argument("--cache-dir", default="~/.cache/flotilla", help="converted-model cache")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--log-dir", type=Path, default=None,
                       help="write each service's output to DIR/<service>.log and the restart "
                       "counts to DIR/restarts.json (default: the output comes here, on stderr)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds the services get to finish in-flight requests on the first "
                       "Ctrl-C or SIGTERM before they are killed (a second Ctrl-C stops at once)")
    bench.add_parser(commands)
    return parser



def serve_options(args: argparse.Namespace) -> StackOptions:
    """The stack ``flotilla serve`` runs, from its flags."""
    service_args = engine_service_args(args)
    service_args["scheduler"] += flags(scheduling_policy=args.scheduling_policy,
                                       chunk_step_ratio=args.chunk_step_ratio,
                                       max_decode_stall_ms=args.max_decode_stall_ms,
                                       max_steps_in_flight=args.max_steps_in_flight,
                                       speculative_config=args.speculative_config)
    service_args["scheduler"] += ["--no-prefix-caching"] if args.no_prefix_caching else []
    service_args["scheduler"] += ["--no-admission-reserve"] if args.no_admission_reserve else []
    service_args["worker"] += flags(kv_load_layer_groups=args.kv_load_layer_groups,
                                    **worker_speculation(args.speculative_config))
    service_args["tokenizer"] += flags(served_model_name=args.served_model_name)
    service_args["gateway"] = flags(api_key=args.api_key, routing=args.routing)
    service_args["kvstore"] = flags(kv_host_memory=args.kv_host_memory,
                                    kv_disk_dir=args.kv_disk_dir, kv_disk_size=args.kv_disk_size)
    return StackOptions(
        model=args.model, host=args.host, port=args.port, nats_url=args.nats_url,
        namespace=args.namespace, cache_dir=args.cache_dir, log_level=args.log_level,
        replicas=args.replicas, gateways=args.gateway_workers, log_dir=args.log_dir,
        service_args=service_args, supervise=True,
        shutdown_timeout_s=args.shutdown_timeout, kvstore=not args.no_kvstore
        and tensor_parallel_size_of(args) == 1,  # a tensor-parallel worker has no kvstore yet
        kv_node_id=args.kv_node_id, worker_gpus=gpus_per_replica(args))


def flag_error(args: argparse.Namespace) -> str | None:
    """A flag the services would refuse at start (the stack would restart them until it gave
    up), said at once: None when every flag can run."""
    try:
        worker_speculation(args.speculative_config)
    except ValueError as exc:
        return str(exc)
    if args.gateway_workers < 1:
        return f"--gateway-workers must be at least 1, not {args.gateway_workers}"
    return pacing_flag_error(args) or engine_flag_error(args)


def pacing_flag_error(args: argparse.Namespace) -> str | None:
    """The chunk pacer's targets are numbers, 0 (off) or more."""
    for flag, value in (("--chunk-step-ratio", args.chunk_step_ratio),
                        ("--max-decode-stall-ms", args.max_decode_stall_ms)):
        if value is None:
            continue
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not number >= 0:  # (nan too)
            return f"{flag} must be a number, 0 (off) or more, not {value!r}"
    return None


def serve(args: argparse.Namespace) -> int:
    """Start the stack, restart any child that exits (give up, exit 1, when one keeps
    crashing), and stop it in order on the first Ctrl-C/SIGTERM; the second kills it."""
    error = flag_error(args)
    if error:
        print(f"flotilla: {error}", file=sys.stderr, flush=True)
        return 2
    options = serve_options(args)
    stack = Stack(options)
    stopping = threading.Event()
    started = False

    def request_stop(_signum, _frame) -> None:
        # Only os.write and signals here: the main thread may be inside a print or a wait.
        if stopping.is_set():
            os.write(2, b"\nflotilla: stopping at once\n")
            stack.kill()
            return
        stopping.set()
        os.write(2, f"\nflotilla: stopping (up to {args.shutdown_timeout:g} s for requests in "
                    f"flight; Ctrl-C again to stop at once)\n".encode())
        if not started:
            raise KeyboardInterrupt  # out of stack.start(), which stops what it started

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    print(f"flotilla: starting model {args.model} (the first start converts it, ~30 s)", flush=True)
    try:
        stack.start()
        started = True
        from shared.models import resolve_model  # cached by now: the services resolved it
        name = args.served_model_name or resolve_model(args.model, args.cache_dir).name
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
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
        stack.stop(timeout_s=args.shutdown_timeout + STOP_MARGIN_S)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "bench":
        return bench.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
