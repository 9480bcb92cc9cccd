"""This runner's place in its tensor-parallel group (docs/tensor-parallel.md): the null group
``SingleRank``, rank 0's ``LeaderRank`` that sends every runner call down to the other ranks
(a pipe per rank) and watches them, and ``FollowerRank`` for ranks 1..N-1, which only join in
the collectives and run what ``follow`` reads from rank 0. tp_group.py starts the ranks'
processes and forms the group."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import random
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import torch

from services.worker.config import WorkerConfig
from services.worker.tensor_parallel import TensorParallel
from shared.messages import StepPlan

WATCH_EVERY_S = 0.2
_STEP, _FLUSH, _RESET = b"S", b"F", b"R"
QUIT = b"Q"  # rank 0 is stopping: the other ranks exit
_plans = msgspec.msgpack.Encoder()


class SingleRank:
    """One rank: the model whole, nothing sent, nothing watched (the null group)."""

    tp = TensorParallel()

    def lead_step(self, plan: StepPlan) -> StepPlan:
        return plan

    def lead_flush(self) -> None:
        pass

    def lead_reset(self) -> None:
        pass

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


class FollowerRank(SingleRank):
    """Ranks 1..N-1: rank 0 leads; they only join in the collectives."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp


class LeaderRank(SingleRank):
    """Rank 0: sends every runner call down to the other ranks and watches them."""

    def __init__(self, config: WorkerConfig,
                 processes: list[multiprocessing.process.BaseProcess], links: list,
                 on_lost: Callable[[str], None]):
        """Watches the ranks from here on, so a rank lost while the group forms fails it
        too; ``tp`` is set once the group has formed."""
        self.config = config
        self._processes, self._links = processes, links
        self._on_lost = on_lost
        self._busy_since: float | None = None  # when the runner call now running began
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch_ranks, name="tp-watch", daemon=True)
        self._watcher.start()

    def lead_step(self, plan: StepPlan) -> StepPlan:
        plan = seed_random_draws(plan)
        self._send(_STEP + _plans.encode(plan))
        return plan

    def lead_flush(self) -> None:
        self._send(_FLUSH)

    def lead_reset(self) -> None:
        self._send(_RESET)

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None

    def _send(self, message: bytes) -> None:
        for link in self._links:
            link.send_bytes(message)

    def _watch_ranks(self) -> None:
        sentinels = [process.sentinel for process in self._processes]
        timeout = self.config.tensor_parallel_step_timeout
        while not self._closing.is_set():
            ended = multiprocessing.connection.wait(sentinels, timeout=WATCH_EVERY_S)
            if self._closing.is_set():
                return
            busy_since = self._busy_since
            if ended:
                rank = 1 + sentinels.index(ended[0])
                process = self._processes[rank - 1]
                process.join(timeout=1)
                self._on_lost(f"rank {rank} exited (code {process.exitcode})")
                return
            if busy_since is not None and time.monotonic() - busy_since > timeout:
                self._on_lost(f"a runner call ran past {timeout} s: a rank is hung")
                return

    def close(self) -> None:
        """Stop the other ranks (rank 0 is stopping)."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._send(QUIT)
        # gloo only: NCCL's teardown after graphs that hold its collectives did not return on
        # an H200 pair; rank 0 is exiting then, and its exit frees the communicator
        if torch.distributed.get_backend() == "gloo":
            torch.distributed.destroy_process_group()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def seed_random_draws(plan: StepPlan) -> StepPlan:
    """``plan`` with a seed for each new request that draws at random without one: every rank
    then draws the same tokens from the same logits."""
    if not any(not new.sampling.is_greedy and new.sampling.seed is None
               for new in plan.new_requests):
        return plan
    new_requests = [
        msgspec.structs.replace(new, sampling=msgspec.structs.replace(
            new.sampling, seed=random.getrandbits(62)))
        if not new.sampling.is_greedy and new.sampling.seed is None else new
        for new in plan.new_requests]
    return msgspec.structs.replace(plan, new_requests=new_requests)


def follow(runner, message: bytes) -> None:
    """Run on this rank the runner call rank 0 sent as ``message`` (not QUIT)."""
    kind = message[:1]
    if kind == _STEP:
        runner.submit(msgspec.msgpack.decode(message[1:], type=StepPlan))
    elif kind == _FLUSH:
        runner.flush()
    elif kind == _RESET:
        runner.reset()
    else:
        raise ValueError(f"unknown tensor-parallel call {kind!r}")
