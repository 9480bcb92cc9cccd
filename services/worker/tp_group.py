"""A tensor-parallel worker's ranks as processes (docs/tensor-parallel.md).

Rank 0 is the worker process: it alone talks to NATS. It spawns ranks 1..N-1, one process per
GPU (on CPU: per share of the cores), and they form a torch.distributed group (NCCL on CUDA,
gloo on CPU) that the model's all-reduces run over. Every rank holds a full ``ModelRunner``
over its part of the weights and KV cache, and runs every runner call rank 0 runs, in the same
order: rank 0 sends each step plan, read-back and reset down a pipe per rank before it runs
the call itself, so each rank's requests, block tables, sampling parameters, grammar masks and
in-flight steps are rank 0's. The logits are gathered whole on every rank and every draw is
seeded (rank 0 seeds a plan's unseeded random requests before sending it), so every rank
samples the same tokens without another collective.

Failure is the group's: a rank that exits, or a call that runs past
``tensor_parallel_step_timeout`` (a rank hung in a collective), ends rank 0 with
EXIT_RANK_LOST at once, and ranks 1.. die with their parent (PR_SET_PDEATHSIG); the supervisor
(or Kubernetes) restarts the worker and the scheduler migrates its requests as for any worker
restart. Nobody waits out NCCL's own timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from datetime import timedelta

import msgspec
import structlog
import torch

from services.worker.config import WorkerConfig
from services.worker.one_shot_reduce import one_shot_reduce
from services.worker.runner_build import build_runner
from services.worker.tensor_parallel import TensorParallel
from services.worker.tp_ranks import QUIT, FollowerRank, LeaderRank, follow
from shared.logging import setup_logging
from shared.models import ModelFiles
from shared.runtime import freeze_startup_objects

log = structlog.get_logger()

EXIT_RANK_LOST = 76  # a tensor-parallel rank died or hung: restart the whole group
JOIN_TIMEOUT = timedelta(minutes=10)  # forming the group: the ranks' model loads race to it


def rank_config(config: WorkerConfig, rank: int) -> WorkerConfig:
    """``config`` as rank ``rank`` runs it: its own GPU (cuda:k+rank for --device cuda:k) or,
    on CPU, its share of the cores."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        device = f"cuda:{int(index or 0) + rank}"
    num_threads = config.num_threads
    if device == "cpu" and not num_threads:
        num_threads = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return msgspec.structs.replace(config, device=device, num_threads=num_threads)


def start_group(config: WorkerConfig, model_files: ModelFiles,
                on_lost: Callable[[str], None] | None = None) -> tuple[LeaderRank, WorkerConfig]:
    """Spawn ranks 1..N-1 and form the group -> (rank 0's group, rank 0's config). Each rank
    then builds its ``ModelRunner`` of ``model_files`` (the same collectives, in the same
    order). ``on_lost``: what a lost rank does to rank 0 (default: exit with EXIT_RANK_LOST)."""
    size = config.tensor_parallel_size
    port = free_port()
    context = multiprocessing.get_context("spawn")
    processes, links = [], []
    for rank in range(1, size):
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=follower_main, name=f"tp-rank-{rank}",
                                  args=(config, model_files, rank, port, receive,
                                        os.getpid()))
        process.start()
        receive.close()
        processes.append(process)
        links.append(send)
    leader = LeaderRank(config, processes, links, on_lost or exit_group)
    leader_config = rank_config(config, 0)
    leader.tp = join_group(leader_config, 0, size, port)
    log.info("tensor_parallel_group_formed", size=size, device=leader_config.device)
    return leader, leader_config


def join_group(config: WorkerConfig, rank: int, size: int, port: int) -> TensorParallel:
    """This process as ``rank`` of the group: NCCL between GPUs, gloo between CPU processes."""
    on_cuda = config.device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(torch.device(config.device))  # NCCL's and Triton's device
    torch.distributed.init_process_group(
        "nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size, timeout=JOIN_TIMEOUT,
        device_id=torch.device(config.device) if on_cuda else None)
    tp = TensorParallel(rank=rank, size=size, group=torch.distributed.group.WORLD)
    if on_cuda and not config.disable_custom_all_reduce:
        tp = dataclasses.replace(tp, one_shot=one_shot_reduce(
            tp.group, torch.device(config.device), tp.agree_min))
    return tp


def exit_group(reason: str) -> None:
    log.error("tensor_parallel_group_lost", reason=reason, code=EXIT_RANK_LOST)
    os._exit(EXIT_RANK_LOST)  # now: the main thread may be stuck in a collective


def follower_main(config: WorkerConfig, model_files: ModelFiles, rank: int, port: int, link,
                  parent_pid: int) -> None:
    """Rank ``rank``'s process: join the group, build the runner, then run what rank 0 sends
    until it says quit or is gone."""
    _die_with_parent(parent_pid)

    setup_logging("worker", level=config.log_level, json=config.log_json)
    structlog.contextvars.bind_contextvars(service="worker", instance=config.instance_id,
                                           tensor_parallel_rank=rank)
    config = rank_config(config, rank)
    tp = join_group(config, rank, config.tensor_parallel_size, port)
    runner = build_runner(config, model_files, FollowerRank(tp))
    # As rank 0's process does: in a traced 70B TP2 step rank 0 waited 107 ms in its first
    # all-reduce for this rank, which a full collection over this heap would explain; with
    # the freeze the same trace showed no such wait and no collection over 20 ms.
    freeze_startup_objects()
    while True:
        try:
            message = link.recv_bytes()
        except EOFError:  # rank 0 is gone
            os._exit(EXIT_RANK_LOST)
        if message[:1] == QUIT:
            os._exit(0)  # no teardown: see LeaderRank.close (tp_ranks.py)
        try:
            follow(runner, message)
        except Exception:  # noqa: BLE001 - rank 0 fails the same call and sends a reset
            log.exception("tensor_parallel_call_failed", rank=rank)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when rank 0 dies (Linux); and exit now if it already has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(EXIT_RANK_LOST)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
