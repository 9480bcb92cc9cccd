"""The control path of one long prompt (issue 14, prefix16k): where a 16k-token request's
time goes outside the model, on the CPU.

Two parts, both on this machine's CPU:

    .venv/bin/python -m benchmarks.long_prompt_path stages [--prompt-len 16384] [--reps 50]
    .venv/bin/python -m benchmarks.long_prompt_path kvhit [--reps 200]
    .venv/bin/python -m benchmarks.long_prompt_path e2e --model .devmodels/dummy-tiny-llama-32k

``stages``: each step of the path in process (no NATS), as the services run it: the
gateway's body parse and validation, its token-id check and routing hashes, the submit's
message, the scheduler's decode and prefix query, the kvstore lookup + pin of the hit
(request and reply through msgpack), the client's check of the pinned tokens, the new
request in the step plan. Milliseconds per call, the median of ``--reps``.

``kvhit``: the scheduler's lookup + pin of the prompt's 1,023 blocks (all host hits) at
a real kvstore process over a real nats-server, one at a time, as ``KvClient.find_hit``
makes it: milliseconds per hit (median, p90) and the CPU time of each side per hit.

``e2e``: the whole stack (gateway, tokenizer, scheduler, worker, kvstore, nats-server) with
a tiny long-context model (random weights; ``.devmodels/dummy-tiny-llama-32k``, made on
first use: the tiny-llama preset with max_position_embeddings 32,768), so the forward is small and a
cached prompt's TTFT is nearly all control path. One 16k-token prompt is computed once
(recompute: long on a CPU, its attention is quadratic); then each rep sends it again (a
worker-cache hit), then short fresh prompts until the worker's cache has evicted it, then
it again (a host-tier hit). Streaming, greedy, TTFT at
the first chunk with a choice; medians over ``--reps`` after a warm-up rep.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


OUT = Path(os.environ.get("OUT", "/tmp/out"))
BLOCK_SIZE = 16


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of one call (after one untimed call)."""
    fn()
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


# ------------------------------------------------------------------ stages
def stages(args) -> dict:
    import random

    import msgspec

    from services.gateway import protocol
    from services.gateway.block_index import BlockIndex
    from services.gateway.routing import Replica, Router, RoutingParams
    from services.kvstore.host_tier import HostTier
    from services.kvstore.owners import OwnerClock
    from services.kvstore.store import KvStore, Namespace
    from services.scheduler import kv_client
    from shared.errors import check_token_ids
    from shared.messages import GenerateRequest, SamplingParams, decode, encode
    from shared.scheduler_stats import EngineStats, RoutingStats, SchedulerStats
    from shared.kv_messages import KvLookupReply, KvLookupRequest
    from shared.prefix_hash import extra_keys, usable_block_hashes

    rng = random.Random(0)
    token_ids = [rng.randrange(200, 40_000) for _ in range(args.prompt_len)]
    model = "dummy-tiny-llama-32k"
    body = json.dumps({"model": model, "prompt": token_ids, "max_tokens": 4, "temperature": 0.0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    keys = extra_keys(model)
    block_hashes = usable_block_hashes(token_ids, BLOCK_SIZE, keys)
    results: dict[str, float] = {}

    def stage(name: str, fn: Callable[[], object]) -> None:
        results[name] = timed(fn, args.reps)
        print(f"{name:58s} {results[name]:8.3f} ms", flush=True)

    # gateway: body -> request -> prompt ids -> routing -> the submit's message
    from services.gateway.http_input import read_json

    class Body:  # what read_json takes of a starlette Request
        async def body(self) -> bytes:
            return body

    loop = asyncio.new_event_loop()
    stage("gateway: read_json (the body parsed)",
          lambda: loop.run_until_complete(read_json(Body())))
    payload = json.loads(body)
    stage("gateway: CompletionRequest validation",
          lambda: protocol.parse_request(protocol.CompletionRequest, payload))
    request = protocol.parse_request(protocol.CompletionRequest, payload)
    prompt = request.prompts_or_document_start(None)[0]
    stage("gateway: check_token_ids", lambda: check_token_ids(prompt, 49_152, "prompt"))
    stats = SchedulerStats(scheduler_id="s0", replica_id="0", timestamp=time.time(),
                           num_running=0, num_waiting=0, num_steps=1, worker_ready=True,
                           routing=RoutingStats(block_size=BLOCK_SIZE, model_name=model,
                                                kv_node_id="local", kv_namespace="ns",
                                                block_bytes=2 << 20),
                           engine=EngineStats(num_blocks_used=1024, num_blocks_total=2048))
    router = Router(RoutingParams("kv", 0, 0.5, 600.0, 10_000), BlockIndex())
    # two replicas: with one the router does not hash the prompt (no choice to make)
    other = msgspec.structs.replace(stats, scheduler_id="s1", replica_id="1")
    replicas = [Replica(stats, 0, 0, 0), Replica(other, 0, 0, 0)]
    stage("gateway: kv routing (hashes + index)",
          lambda: router.choose(replicas, [*token_ids], cache_salt=None, session=None,
                                now=time.monotonic(), max_tokens=4))
    sampling = SamplingParams(max_tokens=4)
    generate = GenerateRequest(request_id="r" * 32, prompt_token_ids=prompt, sampling=sampling,
                               output_subject="gw")
    stage("gateway: encode GenerateRequest", lambda: encode(generate))
    wire = encode(generate)

    # scheduler: decode, prefix query (hashes), kvstore lookup + pin, confirmation
    stage("scheduler: decode GenerateRequest", lambda: decode(wire, GenerateRequest))
    stage("scheduler: prefix hashes (usable_block_hashes)",
          lambda: usable_block_hashes([*prompt], BLOCK_SIZE, keys))
    store = _filled_store(block_hashes, token_ids, KvStore, Namespace, HostTier, OwnerClock)
    host = store.namespaces["ns"].host
    pins = iter(range(10**9))
    lookup_wire = encode(KvLookupRequest(namespace="ns", block_hashes=block_hashes,
                                         owner_id="sched", pin_id="p"))

    def kvstore_side() -> bytes:  # as its handler: decode, look up and pin, encode the reply
        request_in = decode(lookup_wire, KvLookupRequest)
        found = store.lookup(request_in, 0.0)
        reply = encode(KvLookupReply(store_id="store", tiers=found.tiers,
                                     slot_ids=found.slot_ids, token_ids=found.token_ids))
        host.release([request_in.pin_id])  # (the scheduler releases it after the load)
        return reply

    stage("kvstore: lookup + pin (request decoded, reply encoded)", kvstore_side)
    reply_wire = kvstore_side()
    # the client's view of the reply, as it decodes it (its tokens maybe left encoded)
    reply_type = getattr(kv_client, "LookupReply", KvLookupReply)
    client = kv_client.KvClient.__new__(kv_client.KvClient)
    client.block_size = BLOCK_SIZE

    def client_side() -> int:  # encode the lookup, decode the reply, confirm its tokens
        encode(KvLookupRequest(namespace="ns", block_hashes=block_hashes, owner_id="sched",
                               pin_id=f"p{next(pins)}"))
        return client._num_confirmed(decode(reply_wire, reply_type), 0, [*prompt])

    stage("scheduler: lookup encoded, reply decoded, tokens confirmed", client_side)
    assert client_side() == len(block_hashes)

    scheduler_core(stage, generate, wire, reply_type, reply_wire, client)
    return results


def scheduler_core(stage, generate, wire: bytes, reply_type, reply_wire: bytes, client) -> None:
    """The scheduler's own work on the submit (decode, validate, prefix query, the hit's
    confirmation, queue) and on the step that runs the request (plan built, encoded,
    decoded at the worker), with a tier hit of every usable block, as its service calls it."""
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.kv_tier import KvTierLedger
    from services.scheduler.request import TierHit
    from services.scheduler.scheduler import Scheduler
    from shared.messages import GenerateRequest, StepPlan, decode, encode

    def new_core() -> Scheduler:
        kv = KvTierLedger(BLOCK_SIZE)
        kv.looks_up = True  # as the kvstore's connector: the core makes each prefix query
        return Scheduler(SchedulerConfig(max_num_batched_tokens=8192), num_blocks=2048,
                         block_size=BLOCK_SIZE, max_model_len=32_768, eos_token_ids=[2],
                         model_name="dummy-tiny-llama-32k", kv=kv)

    reply = decode(reply_wire, reply_type)
    ids = iter(range(10**9))

    def submit(core: Scheduler) -> None:
        request = decode(wire, GenerateRequest)
        request = msgspec.structs.replace(request, request_id=f"r{next(ids)}")
        arrival = core.arrive(request)  # validated, its place in line, its prefix query
        query = arrival.query
        num_confirmed = client._num_confirmed(reply, query.num_gpu_blocks, arrival.token_ids)
        hit = TierHit("pin", "store", query.num_gpu_blocks, tuple(reply.slot_ids[:num_confirmed]),
                      tuple(reply.tiers[:num_confirmed]))
        core.queue(arrival, hit)

    import msgspec

    stage("scheduler: submit handled in the core (lookup reply given)",
          lambda: submit(new_core()))

    def plan() -> StepPlan:
        core = new_core()
        submit(core)
        return core.schedule()

    core_ms = timed(lambda: new_core(), 20)
    stage("scheduler: submit + schedule() of its first step", plan)
    step_plan = plan()
    assert step_plan.new_requests and step_plan.kv_loads, step_plan
    stage("scheduler: encode the StepPlan", lambda: encode(step_plan))
    plan_wire = encode(step_plan)
    stage("worker: decode the StepPlan", lambda: decode(plan_wire, StepPlan))
    print(f"(a fresh Scheduler core, included above: {core_ms:.3f} ms; the plan "
          f"{len(plan_wire):,} bytes)", flush=True)


def _filled_store(block_hashes, token_ids, KvStore, Namespace, HostTier, OwnerClock):
    """A kvstore whose host tier holds every block of the prompt (no arena: lookups only)."""
    store = KvStore("store", "local", disk=None, owner_timeout_s=600.0,
                    max_pinned_fraction=0.5, max_reserved_fraction=0.5)
    host = store.new_host_tier(4 * len(block_hashes))
    for index, block_hash in enumerate(block_hashes):
        host.index(block_hash, host.take_slot(),
                   token_ids[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE])
    namespace = Namespace.__new__(Namespace)
    namespace.name, namespace.host = "ns", host
    store.add_namespace(namespace)
    return store


# ------------------------------------------------------------------ kvhit
def kvhit(args) -> dict:
    """The scheduler's lookup + pin of a long prompt's blocks at a real kvstore process over
    a real nats-server, one at a time, as ``KvClient.find_hit`` makes it (its pin released
    after each)."""
    import subprocess
    import uuid

    from cli.stack import free_port, nats_server_binary
    from shared.runtime import run_event_loop

    work = Path(tempfile.mkdtemp(prefix="long-prompt-kvhit-"))
    port, node_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
    nats_url = f"nats://127.0.0.1:{port}"
    num_blocks = (args.prompt_len - 1) // BLOCK_SIZE
    host_memory = 8 * num_blocks * 2 * BLOCK_SIZE * 8 * 2  # 512-byte slots: room for 8 prompts
    processes = [subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                  stdout=open(work / "nats.log", "w"), stderr=subprocess.STDOUT)]
    result: dict = {}
    try:
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", "--nats-url", nats_url, "--node-id",
             node_id, "--kv-shm-dir", str(work), "--kv-host-memory", str(host_memory)],
            stdout=open(work / "kvstore.log", "w"), stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1]))
        run_event_loop(_kvhit(args, result, nats_url, node_id, processes[1].pid))
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=10)
    return result


async def _kvhit(args, result: dict, nats_url: str, node_id: str, kvstore_pid: int) -> None:
    import random

    from benchmarks.kvstore_requests import cpu_seconds, wait_ready

    from services.scheduler.kv_client import KvClient
    from services.scheduler.intake import PrefixQuery
    from services.scheduler.tiering import TierSpeeds
    from shared.bus import Bus
    from shared.logging import setup_logging
    from shared.messages import Empty
    from shared.kv_messages import (
        KvAttachReply, KvAttachRequest, KvCommitRequest, KvLayout, KvReserveReply,
        KvReserveRequest,
    )
    from shared.prefix_hash import extra_keys, usable_block_hashes
    from shared.subjects import Subjects
    from shared.tracing import setup_tracing, tracer

    setup_logging("bench", level="info")
    setup_tracing("bench")  # as every service, exporter "none"
    subjects = Subjects()
    subject = lambda verb: subjects.kvstore(node_id, verb)  # noqa: E731
    layout = KvLayout(weights_version="bench", dtype="float16", num_layers=1,
                      block_size=BLOCK_SIZE, num_kv_heads=1, head_dim=8)
    worker = await Bus.connect(nats_url, "bench-worker")
    scheduler = await Bus.connect(nats_url, "bench-scheduler")
    await wait_ready(worker, subject("stats"))
    attached = await worker.request(subject("attach"), KvAttachRequest(
        owner_id="bench-worker", layout=layout, itemsize=2), KvAttachReply)
    rng = random.Random(0)
    token_ids = [rng.randrange(200, 40_000) for _ in range(args.prompt_len)]
    block_hashes = usable_block_hashes(token_ids, BLOCK_SIZE, extra_keys("bench"))
    num_blocks = len(block_hashes)
    slot_ids: list[int] = []
    while len(slot_ids) < num_blocks:  # the reservation cap may cut one short
        slot_ids += (await worker.request(subject("reserve"), KvReserveRequest(
            namespace=attached.namespace, owner_id="bench-worker",
            num_slots=num_blocks - len(slot_ids)), KvReserveReply)).slot_ids
        await worker.request(subject("commit"), KvCommitRequest(
            namespace=attached.namespace, owner_id="bench-worker", store_id=attached.store_id,
            block_hashes=block_hashes[:len(slot_ids)], slot_ids=slot_ids,
            token_ids=token_ids[:len(slot_ids) * BLOCK_SIZE], block_size=BLOCK_SIZE), Empty)
    client = KvClient(scheduler, subjects, owner_id="bench-scheduler", node_id=node_id,
                      namespace=attached.namespace, block_bytes=1 << 21, block_size=BLOCK_SIZE,
                      speeds=TierSpeeds())
    samples = []
    kv_cpu, own_cpu = cpu_seconds(kvstore_pid), time.process_time()
    for rep in range(args.reps + 1):
        started = time.perf_counter()
        with tracer.start_as_current_span("submit"):  # as the scheduler's handler runs it
            hit = await client.find_hit(PrefixQuery(block_hashes, 0), token_ids)
        took = (time.perf_counter() - started) * 1e3
        assert hit is not None and len(hit.slot_ids) == num_blocks, hit
        await client.release([hit.pin_id])
        await scheduler.flush()
        if rep:
            samples.append(took)
        else:  # warm-up
            kv_cpu, own_cpu = cpu_seconds(kvstore_pid), time.process_time()
    kv_cpu, own_cpu = cpu_seconds(kvstore_pid) - kv_cpu, time.process_time() - own_cpu
    await worker.close()
    await scheduler.close()
    samples.sort()
    result.update({"num_blocks": num_blocks, "find_hit_ms_median": statistics.median(samples),
                   "find_hit_ms_p90": samples[int(0.9 * len(samples))],
                   "kvstore_cpu_ms_per_hit": kv_cpu / args.reps * 1e3,
                   "client_cpu_ms_per_hit": own_cpu / args.reps * 1e3})
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------ e2e
async def e2e(args) -> dict:
    import httpx
    from benchmarks.kvstore_tiers import Probe, prompt_ids, stream_one, tier_delta

    from cli.stack import Stack, StackOptions, flags, free_port
    from shared.models import resolve_model

    ensure_long_model(Path(args.model))
    model_name = resolve_model(args.model).name
    log_dir = Path(tempfile.mkdtemp(prefix="flotilla-longprompt-"))
    length = args.prompt_len
    worker = flags(device="cpu", max_model_len=length + 1024, kv_cache_memory=args.kv_cache_memory,
                   num_threads=1) + args.worker_args
    # debug lines of the gateway (request_routed) and scheduler (kv_hit_pinned, step_done)
    # place each request's stages on one clock (the timeline)
    # with --spans every service prints its spans (one per handled message) to its log
    spans = ["--otel-exporter", "console"] if args.spans else []
    stack = Stack(StackOptions(
        model=args.model, host="127.0.0.1", port=free_port(), log_dir=log_dir, kvstore=True,
        service_args={"worker": worker + spans,
                      "scheduler": ["--log-level", "debug", *spans, *args.scheduler_args],
                      "gateway": ["--log-level", "debug", *spans],
                      "kvstore": flags(kv_host_memory=args.kv_host_memory) + spans}))
    stack.start(timeout_s=600)
    probe = Probe(stack.nats_url)
    runs: dict[str, list[dict]] = {"worker_cache": [], "host": []}
    try:
        await probe.start()
        await probe.wait_worker_attached()
        num_blocks = (await probe.fresh_stats()).num_blocks_total
        # short fillers: the same blocks evicted for far less attention than 16k prompts
        num_fillers = -(-num_blocks // (args.filler_len // BLOCK_SIZE)) + 1
        print(f"worker cache {num_blocks} blocks; {num_fillers} fillers of {args.filler_len} "
              "tokens evict the prompt", flush=True)
        seeds = iter(range(100_000, 200_000))
        prefix = prompt_ids(0, length)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
            cold = await stream_one(client, model_name, prefix, args.max_tokens)
            print(f"recompute {cold['ttft_s'] * 1e3:.1f} ms", flush=True)
            for rep in range(args.reps + 1):  # rep 0: warm-up
                again = await stream_one(client, model_name, prefix, args.max_tokens)
                for _ in range(num_fillers):
                    await stream_one(client, model_name, prompt_ids(next(seeds), args.filler_len),
                                     1)
                before = await probe.fresh_stats()
                host = await stream_one(client, model_name, prefix, args.max_tokens)
                host["tier_hits"] = tier_delta(before, await probe.fresh_stats())
                host["same_text"] = host["text"] == cold["text"] == again["text"]
                print(f"rep {rep}: worker cache {again['ttft_s'] * 1e3:.1f} ms (cached "
                      f"{again['cached_tokens']}), host {host['ttft_s'] * 1e3:.1f} ms (cached "
                      f"{host['cached_tokens']}, tiers {host['tier_hits']}), same text "
                      f"{host['same_text']}", flush=True)
                if rep:
                    runs["worker_cache"].append(again)
                    runs["host"].append(host)
            if args.profile:
                await profile_hits(args, stack, client, model_name, prefix)
    finally:
        await probe.close()
        stack.stop()
    medians = {name: statistics.median(r["ttft_s"] for r in rs) * 1e3 for name, rs in runs.items()}
    print("TTFT medians (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    timeline = {name: timeline_medians(rs, log_dir) for name, rs in runs.items()}
    if args.spans:
        timeline |= {f"{name}_spans": span_medians(rs, log_dir) for name, rs in runs.items()}
    for name, stages_ms in timeline.items():
        print(f"{name} timeline, medians (ms): " +
              ", ".join(f"{k} {v:.1f}" for k, v in stages_ms.items()))
    return {"ttft_median_ms": medians, "ttft_recompute_ms": cold["ttft_s"] * 1e3,
            "timeline_median_ms": timeline, "runs": runs, "logs": str(log_dir),
            "outputs_identical": all(r["same_text"] for r in runs["host"])}


def ensure_long_model(path: Path, max_position_embeddings: int = 32_768) -> None:
    """The tiny-llama preset (random weights, the default tokenizer) with a context long
    enough for the prompt, made at ``path`` unless something is there already."""
    import shutil

    from shared.models import resolve_model

    if path.exists():
        return
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(resolve_model("dummy:tiny-llama").path, staging)
    config = json.loads((staging / "config.json").read_text())
    config["max_position_embeddings"] = max_position_embeddings
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(path)


def _log_lines(path: Path, event: str) -> list[tuple[float, dict]]:
    """(unix time, key=value fields) of each line of ``event`` in a service's log."""
    found = []
    for line in path.read_text().splitlines():
        if f" {event} " not in line:
            continue
        stamp = datetime.datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00"))
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        found.append((stamp.timestamp(), fields))
    return found


def _spans(path: Path) -> list[tuple[str, float, float]]:
    """(name, start, end) of each span a service printed (--otel-exporter console)."""
    text, decoder, found, at = path.read_text(), json.JSONDecoder(), [], 0
    while (at := text.find("\n{\n", at)) >= 0:
        span, at = decoder.raw_decode(text, at + 1)
        if "start_time" in span:
            found.append((span["name"], *(datetime.datetime.fromisoformat(
                span[key].replace("Z", "+00:00")).timestamp() for key in ("start_time", "end_time"))))
    return found


def span_medians(runs: list[dict], log_dir: Path) -> dict[str, float]:
    """With --spans, each request's path on the handlers' own clocks, medians (ms):
    to_gateway (sent -> the gateway's HTTP span starts: the client's JSON, the transfer),
    gateway (-> routed: body, validation, routing), to_submit (-> the scheduler's submit
    handler starts), submit (that handler, the kvstore lookup included), kvstore_lookup
    (its handler), to_step (the submit answered -> the worker's handler of the step that
    computes it starts: planning, the plan over NATS, its decode), worker (that handler:
    the step, the result sent), to_output (-> the gateway's handler of that step's outputs
    starts: the result over NATS, the scheduler's update, the outputs published),
    output_to_token (-> the client has the first token: SSE)."""
    routed = [t for t, _ in _log_lines(log_dir / "gateway.log", "request_routed")]
    spans = {name: _spans(log_dir / f"{name}.log") for name in ("gateway", "scheduler",
                                                                "worker", "kvstore")}
    stages_ms: dict[str, list[float]] = {}
    for run in runs:
        sent, first = run["sent_at"], run["first_token_at"]

        def within(service: str, suffix: str) -> list[tuple[str, float, float]]:
            return [sp for sp in spans[service] if sent <= sp[1] <= first
                    and sp[0].endswith(suffix)]

        http = within("gateway", "/v1/completions")
        routed_at = next((t for t in routed if sent <= t <= first), None)
        submit = within("scheduler", ".submit")
        outputs = within("gateway", ".outputs")  # the last before the token: the token's
        steps = [sp for sp in within("worker", ".step") if outputs and sp[2] <= outputs[-1][1]]
        if not (http and routed_at and submit and outputs and steps):
            continue
        http, submit, output, step = http[0], submit[0], outputs[-1], steps[-1]
        values = {"to_gateway": http[1] - sent, "gateway": routed_at - http[1],
                  "to_submit": submit[1] - routed_at, "submit": submit[2] - submit[1],
                  "to_step": step[1] - submit[2], "worker": step[2] - step[1],
                  "to_output": output[1] - step[2], "output_to_token": first - output[1]}
        lookup = within("kvstore", ".lookup")
        if lookup:
            values["kvstore_lookup"] = lookup[0][2] - lookup[0][1]
        for name, seconds in values.items():
            stages_ms.setdefault(name, []).append(seconds * 1e3)
    return {name: statistics.median(values) for name, values in stages_ms.items()}


def timeline_medians(runs: list[dict], log_dir: Path) -> dict[str, float]:
    """Where each request's TTFT went, on the services' clocks (one machine), medians:
    http_parse (sent -> the gateway routed it: HTTP, body, validation, routing),
    submit_to_lookup (-> the scheduler's kvstore lookup starts: the submit over NATS, its
    decode, the prefix query), lookup_pin (find_hit), lookup_to_step (-> the first step
    that computes it starts at the worker: plan over NATS, the worker's own preparation,
    less the steps before), step (the worker's time for that step), step_to_token (-> the
    client has the first token: the result over NATS, outputs, SSE)."""
    routed = [t for t, _ in _log_lines(log_dir / "gateway.log", "request_routed")]
    hits = [(t, f) for t, f in _log_lines(log_dir / "scheduler.log", "kv_hit_pinned")]
    steps = [(t, f) for t, f in _log_lines(log_dir / "scheduler.log", "step_done")]
    stages_ms: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        stages_ms.setdefault(name, []).append(seconds * 1e3)

    for run in runs:
        sent, first = run["sent_at"], run["first_token_at"]
        routed_at = next((t for t in routed if sent <= t <= first), None)
        hit = next(((t, f) for t, f in hits if sent <= t <= first), None)
        # the step whose result gave the first token: the last one done before it
        done = [(t, f) for t, f in steps if sent <= t <= first]
        if routed_at is None or not done:
            continue
        step_at, step = done[-1]
        step_s = float(step["worker_time_s"])
        add("http_parse", routed_at - sent)
        if hit is not None:
            hit_at, fields = hit
            lookup_s = (float(fields["lookup_ms"]) + float(fields["pin_ms"])) / 1e3
            add("submit_to_lookup", hit_at - lookup_s - routed_at)
            add("lookup_pin", lookup_s)
            add("lookup_to_step", step_at - step_s - hit_at)
        else:
            add("submit_to_step", step_at - step_s - routed_at)
        add("step", step_s)
        add("step_to_token", first - step_at)
        add("ttft", first - sent)
    return {name: statistics.median(values) for name, values in stages_ms.items()}


async def profile_hits(args, stack, client, model_name: str, prefix: list[int]) -> None:
    """py-spy (raw collapsed stacks, idle frames left out) on each service while the prompt
    is sent ``--profile-requests`` more times, each a worker-cache hit."""
    import subprocess

    from benchmarks.kvstore_tiers import stream_one

    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    spies = [subprocess.Popen(["py-spy", "record", "--format", "raw", "--rate", "1000",
                               "--output", str(out / f"{name}.txt"), "--pid", str(process.pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, process in stack.processes.items()]
    await asyncio.sleep(2.0)  # py-spy attaches
    for _ in range(args.profile_requests):
        await stream_one(client, model_name, prefix, args.max_tokens)
    for spy in spies:
        spy.send_signal(2)  # SIGINT: py-spy writes its file and exits
    for spy in spies:
        spy.wait(timeout=30)
    print(f"profiles: {out}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("stages", "kvhit", "e2e"))
    parser.add_argument("--prompt-len", type=int, default=16_384)
    parser.add_argument("--reps", type=int, default=None,
                        help="default: 50 calls per stage, 5 requests per kind in e2e")
    parser.add_argument("--model", default=".devmodels/dummy-tiny-llama-32k")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="10MiB",
                        help="the worker's cache (the tiny model: 512 bytes a token)")
    parser.add_argument("--kv-host-memory", default="1GiB")
    parser.add_argument("--filler-len", type=int, default=2048,
                        help="e2e: the prompts that evict the long one from the worker's cache")
    parser.add_argument("--profile", default="", help="e2e: a directory for py-spy profiles "
                        "of each service over --profile-requests worker-cache hits")
    parser.add_argument("--profile-requests", type=int, default=40)
    parser.add_argument("--spans", action="store_true", help="e2e: every service exports its "
                        "spans to its log (--otel-exporter console): the timeline adds the "
                        "handlers' own times (it costs them some CPU)")
    parser.add_argument("--worker-args", type=lambda s: s.split(), default=[])
    parser.add_argument("--scheduler-args", type=lambda s: s.split(), default=[])
    args = parser.parse_args()
    args.reps = args.reps or {"stages": 50, "kvhit": 200, "e2e": 5}[args.part]
    started = time.time()
    result = {"part": args.part, "prompt_len": args.prompt_len, "loadavg_before": os.getloadavg(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    result |= stages(args) if args.part == "stages" else kvhit(args) if args.part == "kvhit" \
        else {"e2e": asyncio.run(e2e(args))}
    result["loadavg_after"], result["wall_s"] = os.getloadavg(), time.time() - started
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"long_prompt_path_{args.part}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"result: {path}")


if __name__ == "__main__":
    main()
