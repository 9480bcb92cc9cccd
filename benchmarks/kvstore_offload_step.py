"""The host cost of write-through offload per step, at 0% hits (issue 14): what storing
a 16,384-token prefill step's ~1,000 completed blocks costs the worker's host threads,
phase by phase, on CPU.

    .venv/bin/python -m benchmarks.kvstore_offload_step [--steps 12] [--prompt-len 1024]

The real step loop in one process, no NATS: a ``Scheduler`` plans each step (kvstore on:
its ``kv_stores``), the plan is encoded and decoded as the bus does, a ``ModelRunner`` on
CPU runs it with a ``KvOffload`` on a real arena, the commits are built and encoded as the
worker service publishes them, and a ``KvStore`` (in process here, its own process when
served) decodes and indexes them and tops up the worker's reservation. Each step is
``--max-num-batched-tokens // --prompt-len`` fresh prompts computed whole, each finishing
there (``max_tokens`` 1): 1,024 completed blocks per step at the defaults, as in
benchmark c's prefill steps on the H200. The model is a tiny random Llama (the forward is
not what is measured; slots of 2 KiB keep the CPU copy itself small: on CUDA it is DMA on a
copy stream and costs the host only its launches).

Reported per step (median over ``--steps`` after ``--warmup``), in host milliseconds:
  worker   plan_decode   the plan's decode, minus the same plan's without kv_stores (bus thread)
           resolve       KvOffload.resolve_stores: the runs checked against the requests
           store         KvOffload.store (both calls), of which ``copy`` is KvTiers.store
           glue          the rest of the KV connector's before_forward (filtering, waits)
           end_submit    KvOffload.end_submit: token ids read, commits built
           commit_encode the commit messages built (kv_offload.commit_messages) and encoded
                         (bus thread)
  scheduler plan_stores KvTierLedger.take_plan_stores (another process)
           plan_kv       Scheduler.schedule with stores on minus off (noisy: two runs)
           plan_encode   the plan's encode, minus the same plan's without kv_stores
  kvstore  commit        decode + KvStore.commit of the messages (another process)
and ``worker_total`` (the worker rows summed) and ``worker_less_copy`` (without the copy
calls), with the blocks stored per step. Also
``submit_host`` = ModelRunner.submit less its forward, with stores on and off.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path


import msgspec
import torch

from services.kvstore.store import KvStore, Namespace, slot_nbytes_of
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_tier import KvTierHooks, KvTierLedger
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.kv_offload import KvOffload
from services.worker.kv_tiers import KvTiers
from services.worker.runner_build import build_runner
from shared.kv_arena import KvArena
from shared.logging import setup_logging
from shared.messages import GenerateRequest, SamplingParams, StepPlan, decode, encode
from shared.kv_messages import KvCommitRequest
from shared.models import ModelFiles

BLOCK_SIZE = 16
# 1 layer, 1 KV head of 16: a 2 KiB block in fp32
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
            rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None)
BLOCK_BYTES = 1 * 2 * BLOCK_SIZE * 1 * 16 * 4  # layers, K/V, tokens, KV heads, head size, fp32
OWNER = "bench-worker"


def tiny_model(work: Path) -> ModelFiles:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).eval().save_pretrained(work / "tiny",
                                                                  safe_serialization=True)
    return ModelFiles(name="tiny-llama", path=work / "tiny")


class Timers:
    """Host seconds per phase within the current step, from methods wrapped on instances; a
    call made inside another wrapped one also counts as "outer/inner"."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self._active: list[str] = []

    def wrap(self, owner: object, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            outer = self._active[-1] if self._active else None
            self._active.append(phase)
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                self._active.pop()
                self.step[phase] += took
                if outer is not None:
                    self.step[f"{outer}/{phase}"] += took

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        step, self.step = dict(self.step), defaultdict(float)
        return step


def build_commits(offload: KvOffload, namespace: str) -> list[KvCommitRequest]:
    """The commit messages, built as the worker service does."""
    try:
        from services.worker.kv_offload import commit_messages
    except ImportError:  # a tree before it: the service's loop then, one struct per block
        messages = []
        for commit in offload.take_commits():
            for first in range(0, max(len(commit.blocks), 1), 512):
                messages.append(KvCommitRequest(
                    namespace=namespace, owner_id=OWNER, store_id=commit.store_id,
                    blocks=commit.blocks[first:first + 512],
                    returned_slot_ids=commit.returned_slot_ids
                    if first + 512 >= len(commit.blocks) else []))
        return messages
    if "columns" in inspect.signature(commit_messages).parameters:
        return commit_messages(offload.take_commits(), namespace, OWNER, offload.commit_columns)
    return commit_messages(offload.take_commits(), namespace, OWNER)


def timed(call: Callable[[], object]) -> tuple[object, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def run(args: argparse.Namespace, model: ModelFiles, work: Path, kvstore: bool) -> list[dict]:
    """Per measured step: host seconds by phase (kvstore on) or the baseline's (off)."""
    budget = args.max_num_batched_tokens
    num_blocks = budget // BLOCK_SIZE  # a step's blocks; the cache holds four steps'
    runner = build_runner(WorkerConfig(device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                                      kv_cache_memory=str(4 * num_blocks * BLOCK_BYTES),
                                      max_num_batched_tokens=budget, overlap_steps="off"),
                         model)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=budget),
                          num_blocks=runner.num_blocks, block_size=BLOCK_SIZE,
                          max_model_len=4096, eos_token_ids=[], model_name="tiny",
                          kv=KvTierLedger(BLOCK_SIZE) if kvstore else KvTierHooks())
    timers = Timers()
    if hasattr(runner, "_forward"):
        timers.wrap(runner, "_forward", "forward")
    else:  # a runner that calls its model directly
        timers.wrap(runner.model, "forward", "forward")
    if kvstore:
        timers.wrap(scheduler.kv, "take_plan_stores", "plan_stores")

    store = offload = namespace = None
    if kvstore:
        layout = runner.kv_layout("bench")
        namespace, slot_nbytes = layout.namespace, slot_nbytes_of(layout, 4)
        num_slots = 8 * num_blocks
        store = KvStore("store-1", "bench", disk=None, owner_timeout_s=3600.0,
                        max_pinned_fraction=0.5, max_reserved_fraction=0.5)
        arena = KvArena.create(work / f"arena-{time.monotonic_ns()}", num_slots, slot_nbytes,
                               "store-1")
        store.add_namespace(Namespace(namespace, slot_nbytes, arena, store.new_host_tier(num_slots)))
        columns = {"commit_columns": True} if "commit_columns" in inspect.signature(
            KvOffload).parameters else {}  # this kvstore reads them (the attach reply says so)
        offload = KvOffload(KvTiers(runner.kv_cache, KvArena.attach(arena.path)), "store-1",
                            BLOCK_SIZE, max_blocks_per_step=num_blocks + 256, **columns)
        runner.attach_kv(offload)
        timers.wrap(offload, "resolve_stores", "resolve")
        timers.wrap(offload, "store", "store")
        timers.wrap(offload.tiers, "store", "copy")
        timers.wrap(offload, "end_submit", "end_submit")
        if hasattr(runner, "_kv_before_forward"):  # a tree before the KV connector
            timers.wrap(runner, "_kv_before_forward", "before_forward")
        else:
            timers.wrap(runner.kv, "before_forward", "before_forward")
    rng = random.Random(args.seed)
    num_per_step = budget // args.prompt_len
    sampling = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for index in range((args.warmup + args.steps) * num_per_step):
        scheduler.add_request(GenerateRequest(
            request_id=f"r{index}", sampling=sampling, output_subject="out",
            prompt_token_ids=[rng.randrange(1, TINY["vocab_size"])
                              for _ in range(args.prompt_len)]))
    steps = []
    gc.collect()  # as each service at start (shared.runtime.freeze_startup_objects): the
    gc.freeze()  # collector walks only what the step loop makes, not the model and prompts
    while scheduler.has_work:
        if offload is not None:  # the service tops the reservation up after each step
            offload.slot_pool.add(store.reserve(namespace, OWNER, offload.slots_wanted(), 0.0))
        plan, schedule_s = timed(scheduler.schedule)
        if plan is None:
            break
        data, encode_s = timed(lambda: encode(plan))
        bare = msgspec.structs.replace(plan, kv_stores=[])
        bare_data, bare_encode_s = timed(lambda: encode(bare))
        plan, decode_s = timed(lambda: decode(data, StepPlan))
        _, bare_decode_s = timed(lambda: decode(bare_data, StepPlan))
        results, submit_s = timed(lambda: runner.submit(plan))
        results += runner.flush()
        for result in results:
            scheduler.update(plan, result)
        phases = timers.take()
        step = {"schedule": schedule_s, "submit_host": submit_s - phases.pop("forward", 0.0),
                "num_blocks": sum(len(run.block_ids) for run in plan.kv_stores),
                "num_tokens": sum(s.num_new_tokens for s in plan.scheduled)}
        if offload is not None:
            messages, build_s = timed(lambda: build_commits(offload, namespace))
            payloads, encode_commits_s = timed(lambda: [encode(m) for m in messages])

            def kvstore_commit() -> int:
                return sum(len(store.commit(decode(p, KvCommitRequest), 0.0)) for p in payloads)

            num_committed, kvstore_s = timed(kvstore_commit)
            before = phases.get("before_forward", 0.0)
            step |= {
                "plan_decode": decode_s - bare_decode_s, "resolve": phases.get("resolve", 0.0),
                "store": phases.get("store", 0.0), "copy": phases.get("copy", 0.0),
                # the runner's own kv work before the forward (filtering, waits)
                "glue": before - phases.get("before_forward/resolve", 0.0)
                - phases.get("before_forward/store", 0.0),
                "end_submit": phases.get("end_submit", 0.0),
                "commit_encode": build_s + encode_commits_s,
                "plan_encode": encode_s - bare_encode_s, "kvstore_commit": kvstore_s,
                "plan_stores": phases.get("plan_stores", 0.0),
                "num_committed": num_committed}
        steps.append(step)
    gc.unfreeze()
    if offload is not None:
        offload.close()
    return [s for s in steps if s["num_tokens"] == budget][args.warmup:]


WORKER_PHASES = ("plan_decode", "resolve", "store", "glue", "end_submit", "commit_encode")


def summarize(on: list[dict], off: list[dict]) -> dict:
    def median_ms(rows: list[dict], key: str) -> float:
        return round(statistics.median(row[key] for row in rows) * 1e3, 3)

    summary = {key: median_ms(on, key) for key in (*WORKER_PHASES, "copy", "plan_stores",
                                                    "plan_encode", "kvstore_commit")}
    summary["worker_total"] = round(sum(summary[key] for key in WORKER_PHASES), 3)
    # the copies themselves: on CPU, memcpy (one call per run of consecutive slots and
    # blocks); on CUDA, launches on the copy stream
    summary["worker_less_copy"] = round(summary["worker_total"] - summary["copy"], 3)
    summary["plan_kv"] = round(median_ms(on, "schedule") - median_ms(off, "schedule"), 3)
    summary["submit_host_on"] = median_ms(on, "submit_host")
    summary["submit_host_off"] = median_ms(off, "submit_host")
    summary["num_blocks"] = statistics.median(row["num_blocks"] for row in on)
    summary["num_committed"] = statistics.median(row["num_committed"] for row in on)
    summary["num_steps"] = len(on)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="measured steps per pass")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--passes", type=int, default=2,
                        help="stores off then on, this many times (medians of each)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the forward)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write the result as JSON here")
    args = parser.parse_args()
    setup_logging("bench", level="warning")
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="kvstore-offload-step-"))
    model = tiny_model(work)
    passes = []
    for index in range(args.passes):
        off = run(args, model, work, kvstore=False)
        on = run(args, model, work, kvstore=True)
        passes.append(summarize(on, off))
        print(json.dumps({"pass": index, **passes[-1]}), flush=True)
    result = {"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "median_of_passes": {key: statistics.median(p[key] for p in passes)
                                   for key in passes[0]}, "passes": passes}
    print(json.dumps({"median_of_passes": result["median_of_passes"]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
