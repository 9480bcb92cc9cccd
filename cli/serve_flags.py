"""``flotilla serve``'s flags, made from the services' sections, and the stack they describe.

Each flag is one knob of one section (shared/sections/): serve has the knobs of every
service it starts, each once, plus its own (``Serve``). Every service's config is built here,
in process, before anything starts, so a bad value or one this host cannot run exits with
the flag's name; the children get the same values as flags (shared.config.config_flags).
``flotilla bench`` starts its stacks through the same functions with the engine's knobs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from cli.stack import StackOptions
from services.gateway.config import GatewayConfig
from services.kvstore.config import KvStoreConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig, host_error
from shared import limits
from shared.config import (
    ENV_PREFIX, ConfigError, Knob, Section, add_knobs, build_config, compose, config_flags, knob,
    knobs_of, section_knobs)
from shared.sections.engine import (
    BatchLimits, Compute, ContextLimit, KvCache, Parallel, Weights)
from shared.sections.scheduling import Scheduling
from shared.sections.speculative import Speculation

SERVICE_CONFIGS: dict[str, type] = {
    "gateway": GatewayConfig, "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig,
    "worker": WorkerConfig, "kvstore": KvStoreConfig}
# What the stack gives every process itself (cli/stack.py: Stack.service_command).
SET_BY_STACK = frozenset({"model", "namespace", "cache_dir", "log_level", "host", "port"})
# The knobs ``flotilla bench`` takes for the stack it starts (when no --base-url is given).
ENGINE_SECTIONS = (BatchLimits, ContextLimit, Weights, KvCache, Compute, Parallel, Scheduling,
                   Speculation)


class Serve(Section, frozen=True, kw_only=True):
    """The stack's own knobs: what runs, where NATS is, where logs go, how it stops."""

    nats_url: Annotated[str, knob(
        "use this NATS server instead of starting one (every service connects to it)")] = ""
    replicas: Annotated[int, knob(
        "scheduler+worker pairs; the gateway routes between them (--routing)")] = 1
    gateway_workers: Annotated[int, knob(
        "gateway processes sharing --port (SO_REUSEPORT; each its own NATS client and "
        "streams): more streams' chunks written per second (docs/deploy.md)")] = 1
    tokenizer_workers: Annotated[int, knob(
        "tokenizer processes (one NATS queue group: each encode goes to one of them); images "
        "are decoded and preprocessed there, so a vision model on a many-core host takes "
        "more (docs/vision.md)")] = 1
    kvstore: Annotated[bool, knob(
        "run the node's kvstore: KV blocks below the worker's cache in host RAM and optionally "
        "on disk, loaded instead of recomputed when faster (docs/kvstore.md)")] = True
    kv_node_id: Annotated[str, knob(
        "this node's kvstore id (its workers and schedulers use it)")] = "local"
    log_dir: Annotated[str, knob(
        "write each service's output to DIR/<service>.log and the restart counts to "
        "DIR/restarts.json (default: the output comes here, on stderr)")] = ""
    shutdown_timeout: Annotated[float, knob(
        "seconds the services get to finish in-flight requests on the first Ctrl-C or SIGTERM "
        "before they are killed (a second Ctrl-C stops at once)")] = 30.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, not {self.replicas}")
        if self.gateway_workers < 1:
            raise ValueError(f"gateway_workers must be at least 1, not {self.gateway_workers}")
        if self.tokenizer_workers < 1:
            raise ValueError(f"tokenizer_workers must be at least 1, not "
                             f"{self.tokenizer_workers}")


ServeConfig = compose("ServeConfig", "flotilla serve: the whole stack.", (Serve,),
                      module=__name__)


def serve_knobs() -> list[Knob]:
    """Serve's own knobs, then every service's that serve exposes, each once."""
    out: dict[str, Knob] = {k.name: k for k in section_knobs(Serve)}
    for config_cls in SERVICE_CONFIGS.values():
        for k in knobs_of(config_cls):
            if not k.serve:
                continue
            known = out.get(k.name)
            if known is not None and known.section is not k.section:
                raise TypeError(f"--{k.name}: declared in {known.section.__name__} and "
                                f"{k.section.__name__}")
            out.setdefault(k.name, k)
    return list(out.values())


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One argument group a section, in the order of serve_knobs."""
    groups: dict[type, Any] = {}
    for k in serve_knobs():
        if k.section not in groups:
            groups[k.section] = parser.add_argument_group(
                k.section.__name__, (k.section.__doc__ or "").strip() or None)
        add_knobs(groups[k.section], [k], with_env=k.section is not Serve)


def add_engine_flags(parser, skip: tuple[str, ...] = ()) -> None:
    """The engine's knobs (ENGINE_SECTIONS), for ``flotilla bench``'s stack, less ``skip``
    (names the caller's own flags take); ``args.engine_knobs`` names those added."""
    added = [k for section in ENGINE_SECTIONS for k in section_knobs(section)
             if k.name not in skip and k.serve]
    add_knobs(parser, added)
    parser.set_defaults(engine_knobs=tuple(k.name for k in added))


def stack_configs(values: Mapping[str, Any], environ: Mapping[str, str] | None = None
                  ) -> dict[str, Any]:
    """Every service's config (and serve's own, as "serve") from the given values (None: not
    given), with the batch limits' GPU defaults where the worker runs on CUDA. A ConfigError
    names the flag of a bad value or of one this host cannot run."""
    environ = os.environ if environ is None else environ
    given = {name: value for name, value in values.items() if value is not None}
    stack = build_config(ServeConfig, given)
    worker = build_config(WorkerConfig, given, environ)
    if worker.on_cuda:  # the batch limits' GPU defaults (shared/limits.py)
        given = {**{name: value for name, value in limits.device_defaults(on_gpu=True).items()
                    if ENV_PREFIX + name.upper() not in environ}, **given}
        worker = build_config(WorkerConfig, given, environ)
    configs = {kind: build_config(cls, given, environ) for kind, cls in SERVICE_CONFIGS.items()
               if kind != "worker"}
    error = host_error(worker, stack.replicas)
    if error:
        raise ConfigError(error)
    return {"serve": stack, "worker": worker, **configs}


def stack_options(configs: Mapping[str, Any], *, supervise: bool) -> StackOptions:
    """The stack the configs describe: each service's flags are its knobs' values."""
    stack, worker = configs["serve"], configs["worker"]
    service_args = {kind: config_flags(configs[kind], exclude=SET_BY_STACK)
                    for kind in SERVICE_CONFIGS}
    gateway = configs["gateway"]
    return StackOptions(
        model=worker.model, host=gateway.host, port=gateway.port,
        nats_url=stack.nats_url or None, namespace=worker.namespace, cache_dir=worker.cache_dir,
        log_level=worker.log_level, replicas=stack.replicas, gateways=stack.gateway_workers,
        tokenizers=stack.tokenizer_workers,
        log_dir=Path(stack.log_dir) if stack.log_dir else None, service_args=service_args,
        supervise=supervise, shutdown_timeout_s=stack.shutdown_timeout,
        # a tensor-parallel worker has no kvstore yet
        kvstore=stack.kvstore and worker.tensor_parallel_size == 1,
        kv_node_id=stack.kv_node_id, worker_gpus=_gpus_per_replica(worker))


def _gpus_per_replica(worker) -> int | None:
    """GPUs the stack gives each replica's worker, or None: the workers run on the CPU, or
    --device cuda:K names the GPU they share."""
    if not worker.on_cuda or ":" in worker.device:
        return None
    return worker.tensor_parallel_size
