"""The scheduler service with a kvstore, over a real nats-server: the scheduler runs in
this process; the worker (the policy tests' fake, with a host tier) and the kvstore are
stand-ins served on the bus, so each test sets what the kvstore answers, or that it
never answers."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler import kv_client
from services.scheduler.kv_connector import KvConnector, NoKvConnector
from shared.prefix_hash import extend_block_hashes
from services.scheduler.service import SchedulerService
from shared.bus import Bus
from shared.errors import ServiceUnavailable
from shared.messages import (
    AbortRequest, Empty, GenerateRequest, HealthReply, OutputBatch, SamplingParams, StepPlan,
    StepResult, SubmitReply, WorkerInfo,
)
from shared.kv_messages import (
    KvKeepAlive, KvLookupReply, KvLookupRequest, KvPinReply, KvPinRequest, KvReleaseRequest,
)
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects
from tests.services.scheduler.test_kv_client import eventually
from tests.services.scheduler.test_kv_tier import TierWorker
from tests.services.scheduler.test_scheduler import BLOCK_SIZE, EOS, expected_tokens

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("unhurried_kvstore_calls")]

SUBJECTS = Subjects()
NODE = "n1"
NAMESPACE = "ns1"
NUM_BLOCKS = 64
BLOCK_BYTES = 1000
MODEL = "m"


class Peers:
    """The worker and the kvstore, served on the bus. ``kvstore``: "answers", "silent"
    (subscribed, never replies) or "absent" (nobody on its subjects). The kvstore that
    answers pins the leading run of host hits with each lookup, as the real one does; a
    block held on disk only is reported, and pinned (read in) by a pin."""

    def __init__(self, bus: Bus, kvstore: str) -> None:
        self.bus = bus
        self.kvstore = kvstore
        self.worker = TierWorker(NUM_BLOCKS)
        self.plans: list[StepPlan] = []
        self.lookups: list[KvLookupRequest] = []
        self.pins: list[KvPinRequest] = []
        self.released: list[str] = []
        self.keepalives: list[str] = []
        self.outputs: dict[str, list] = {}
        self.stats: list[SchedulerStats] = []
        self.held: dict[bytes, list[int]] = {}  # what the kvstore holds
        self.on_disk: set[bytes] = set()  # of those, the blocks only its disk tier holds
        self.store_id = "store-1"
        # the worker's kvstore as its attach reply and pings say ("": none)
        self.worker_info_has_kv = True
        self.worker_store_id = "store-1"
        self.pin_delay_s = 0.0
        self.lookup_delay_s = 0.0

    async def start(self) -> None:
        bus = self.bus
        await bus.serve(SUBJECTS.worker_attach("0"), Empty, self.on_attach)
        await bus.serve(SUBJECTS.worker_step("0"), StepPlan, self.on_step)
        await bus.serve(SUBJECTS.worker_ping("0"), Empty, self.on_ping)
        await bus.subscribe("out", OutputBatch, self.on_outputs)
        await bus.subscribe(SUBJECTS.scheduler_stats, SchedulerStats, self.on_stats)
        if self.kvstore == "answers":
            await bus.serve(SUBJECTS.kvstore(NODE, "lookup"), KvLookupRequest, self.on_lookup)
            await bus.serve(SUBJECTS.kvstore(NODE, "pin"), KvPinRequest, self.on_pin,
                            concurrent=True)
            await bus.serve(SUBJECTS.kvstore(NODE, "release"), KvReleaseRequest, self.on_release)
            await bus.subscribe(SUBJECTS.kvstore(NODE, "keepalive"), KvKeepAlive, self.on_keepalive)
        elif self.kvstore == "silent":
            await bus.subscribe(SUBJECTS.kvstore(NODE, "lookup"), KvLookupRequest, self.on_silent)
            await bus.subscribe(SUBJECTS.kvstore(NODE, "pin"), KvPinRequest, self.on_silent)

    async def on_attach(self, _: Empty) -> WorkerInfo:
        return WorkerInfo(worker_id="w1", replica_id="0", model_name=MODEL, num_blocks=NUM_BLOCKS,
                          block_size=BLOCK_SIZE, max_model_len=512, eos_token_ids=[EOS],
                          kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES, device="cpu", dtype="float32",
                          kv_namespace=NAMESPACE if self.worker_info_has_kv else "",
                          kv_node_id=NODE if self.worker_info_has_kv else "")

    async def on_step(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = self.worker.execute(plan)
        num_loaded = sum(len(load.slot_ids) for load in plan.kv_loads)
        return StepResult(result.step_id, result.request_ids, result.sampled_token_ids, 0.001,
                          kv_load_bytes=num_loaded * BLOCK_BYTES,
                          kv_load_bytes_per_s=1e9 if num_loaded else 0.0)

    async def on_ping(self, _: Empty) -> HealthReply:
        attached = bool(self.worker_store_id)
        return HealthReply(service="worker", instance_id="w1", detail={
            "nats_disconnects": 0, "kv_node_id": NODE, "kv_attached": attached,
            "kv_namespace": NAMESPACE if attached else "", "kv_store_id": self.worker_store_id})

    async def on_outputs(self, batch: OutputBatch) -> None:
        for output in batch.outputs:
            self.outputs.setdefault(output.request_id, []).append(output)

    async def on_stats(self, stats: SchedulerStats) -> None:
        self.stats.append(stats)

    async def on_lookup(self, request: KvLookupRequest) -> KvLookupReply:
        self.lookups.append(request)
        await asyncio.sleep(self.lookup_delay_s)
        tiers = []
        for block_hash in request.block_hashes:
            if block_hash not in self.held:
                break
            tiers.append("disk" if block_hash in self.on_disk else "host")
        num_host = tiers.index("disk") if "disk" in tiers else len(tiers)
        slot_ids, token_ids = self._pin_slots(request.block_hashes[:num_host])
        return KvLookupReply(store_id=self.store_id, tiers=tiers, slot_ids=slot_ids,
                             token_ids=token_ids)

    async def on_pin(self, request: KvPinRequest) -> KvPinReply:
        self.pins.append(request)
        await asyncio.sleep(self.pin_delay_s)
        slot_ids, token_ids = self._pin_slots(request.block_hashes)
        tiers = ["disk" if h in self.on_disk else "host" for h in request.block_hashes]
        return KvPinReply(store_id=self.store_id, slot_ids=slot_ids, token_ids=token_ids,
                          tiers=tiers[:len(slot_ids)])

    def _pin_slots(self, block_hashes: list[bytes]) -> tuple[list[int], list[list[int]]]:
        slot_ids, token_ids = [], []
        for block_hash in block_hashes:
            slot_id = 1000 + len(self.worker.host_slots)
            self.worker.host_slots[slot_id] = self.held[block_hash]
            slot_ids.append(slot_id)
            token_ids.append(self.held[block_hash])
        return slot_ids, token_ids

    async def on_release(self, request: KvReleaseRequest) -> Empty:
        self.released += request.pin_ids
        return Empty()

    async def on_keepalive(self, message: KvKeepAlive) -> None:
        self.keepalives.append(message.owner_id)

    async def on_silent(self, _) -> None:
        pass

    def hold(self, prompt: list[int], tier: str = "host") -> None:
        """Put the prompt's full blocks in the kvstore's host (or only its disk) tier."""
        block_hashes: list[bytes] = []
        extend_block_hashes(block_hashes, prompt, len(prompt), BLOCK_SIZE, (f"model:{MODEL}",))
        for index, block_hash in enumerate(block_hashes):
            self.held[block_hash] = prompt[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]
            if tier == "disk":
                self.on_disk.add(block_hash)


async def running(nats_url: str, kvstore: str, _peers: dict | None = None, **config):
    """A scheduler attached to the stand-in worker, and the peers (``_peers``: their
    attributes to set before the scheduler attaches)."""
    peer_bus = await Bus.connect(nats_url, "peers")
    peers = Peers(peer_bus, kvstore)
    for name, value in (_peers or {}).items():
        setattr(peers, name, value)
    await peers.start()
    await peer_bus.flush()  # the stand-ins answer before the scheduler's connection asks
    bus = await Bus.connect(nats_url, "scheduler")
    service = SchedulerService(SchedulerConfig(**{"instance_id": "s1", "kv_node_id": NODE,
                                                  "stats_interval_s": 0.05, **config}), bus)
    await service.start()
    stop_event = asyncio.Event()
    task = asyncio.create_task(service.run(stop_event))
    await eventually(lambda: service.worker_attached)

    async def shutdown() -> None:
        stop_event.set()
        await task
        await bus.close()
        await peer_bus.close()

    return service, peers, shutdown


async def submit(bus: Bus, request_id: str, prompt: list[int], max_tokens: int = 3) -> float:
    """Submit; return the seconds until the scheduler took it."""
    started = time.monotonic()
    await bus.request(SUBJECTS.scheduler_submit_to("s1"), GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, output_subject="out",
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True)), SubmitReply, timeout=5)
    return time.monotonic() - started


def prompt_of(base: int, num: int = 26) -> list[int]:
    return list(range(base, base + num))


def tokens_of(peers: Peers, request_id: str) -> list[int]:
    return [t for o in peers.outputs.get(request_id, []) for t in o.new_token_ids]


@pytest.mark.parametrize("kvstore", ["silent", "absent"])
async def test_a_kvstore_that_does_not_answer_delays_no_request_past_the_deadline(
        nats_url, kvstore, monkeypatch):
    lookup_timeout_s = 1.0  # the product's 50 ms, scaled to dwarf a loaded machine's delays
    monkeypatch.setattr(kv_client, "LOOKUP_TIMEOUT_S", lookup_timeout_s)
    service, peers, shutdown = await running(nats_url, kvstore)
    try:
        prompts = {f"r{i}": prompt_of(10_000 * (i + 1)) for i in range(6)}
        waits = await asyncio.gather(*(submit(peers.bus, rid, p) for rid, p in prompts.items()))
        # concurrent lookups: six requests wait one deadline, not two, let alone six
        assert max(waits) < 2 * lookup_timeout_s, waits
        for request_id, prompt in prompts.items():
            await eventually(lambda rid=request_id: len(tokens_of(peers, rid)) == 3)
            assert tokens_of(peers, request_id) == expected_tokens(request_id, len(prompt), 3)
        assert all(not plan.kv_loads for plan in peers.plans)
    finally:
        await shutdown()


async def test_a_host_hit_is_pinned_by_its_lookup_loaded_and_released(nats_url):
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        prompt = prompt_of(50_000)  # 6 full blocks and 2 tokens
        peers.hold(prompt)
        await submit(peers.bus, "a", prompt)
        await eventually(lambda: len(tokens_of(peers, "a")) == 3)
        assert tokens_of(peers, "a") == expected_tokens("a", len(prompt), 3)
        (lookup,) = peers.lookups
        assert len(lookup.block_hashes) == 6  # the last token's block is never a hit
        assert lookup.owner_id == "s1" and lookup.pin_id and not peers.pins  # one round trip
        loads = [load for plan in peers.plans for load in plan.kv_loads]
        assert len(loads) == 1 and len(loads[0].slot_ids) == 6
        assert loads[0].store_id == "store-1"  # the worker loads only that kvstore's slots
        assert peers.outputs["a"][0].num_cached_tokens == 24
        await eventually(lambda: peers.released == [lookup.pin_id])  # after the load
        await eventually(lambda: peers.stats and peers.stats[-1].engine.num_kv_tier_hits == 24)
        assert peers.stats[-1].engine.num_kv_tier_hits_by_tier == {"host": 24, "disk": 0}
        # the tokens computed here went to the kvstore: the 7th block (2 prompt tokens
        # and 2 outputs), with the next plan (the last step of "a" completed it); the
        # loaded ones never go back
        await submit(peers.bus, "next", [1, 2, 3])
        await eventually(lambda: len(tokens_of(peers, "next")) == 3)
        stored = [run for plan in peers.plans for run in plan.kv_stores]
        assert [run.first_block_index for run in stored if run.request_id == "a"] == [6]
    finally:
        await shutdown()


async def test_tier_hits_stay_counted_across_a_worker_re_attach(nats_url):
    """The stats are cumulative: a gateway that sees no stats between a re-attach and the
    next hit must not count only the difference from the old core's total."""
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        prompt = prompt_of(52_000)
        peers.hold(prompt)
        await submit(peers.bus, "a", prompt)
        await eventually(lambda: peers.stats and peers.stats[-1].engine.num_kv_tier_hits == 24)
        await service._reattach(ServiceUnavailable("the worker restarted"))
        await eventually(lambda: service.worker_attached)
        await submit(peers.bus, "b", prompt)
        await eventually(lambda: peers.stats and peers.stats[-1].engine.num_kv_tier_hits == 48)
        assert peers.stats[-1].engine.num_kv_tier_hits_by_tier == {"host": 48, "disk": 0}
    finally:
        await shutdown()


async def test_without_a_kv_node_id_the_null_connector_looks_up_and_stores_nothing(nats_url):
    """The worker names its kvstore, but this scheduler was started without one."""
    service, peers, shutdown = await running(nats_url, "answers", kv_node_id="")
    try:
        prompt = prompt_of(53_000)
        peers.hold(prompt)
        await submit(peers.bus, "n", prompt)
        await eventually(lambda: len(tokens_of(peers, "n")) == 3)
        assert tokens_of(peers, "n") == expected_tokens("n", len(prompt), 3)
        assert type(service.kv) is NoKvConnector and service.core.kv is service.kv
        assert not peers.lookups and peers.plans
        assert all(not plan.kv_loads and not plan.kv_stores for plan in peers.plans)
    finally:
        await shutdown()


async def test_a_miss_is_queued_without_a_pin(nats_url):
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        await submit(peers.bus, "b", prompt_of(60_000))
        await eventually(lambda: len(tokens_of(peers, "b")) == 3)
        assert len(peers.lookups) == 1 and not peers.pins
        # a short prompt has no block to look up
        await submit(peers.bus, "c", [1, 2, 3])
        await eventually(lambda: len(tokens_of(peers, "c")) == 3)
        assert len(peers.lookups) == 1
    finally:
        await shutdown()


async def test_recompute_measured_faster_is_not_pinned(nats_url):
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        speeds = service.tier_speeds
        speeds.prefill_tokens_per_s, speeds.host_load_bytes_per_s = 1e9, 1e3
        prompt = prompt_of(70_000)
        peers.hold(prompt)
        await submit(peers.bus, "d", prompt)
        await eventually(lambda: len(tokens_of(peers, "d")) == 3)
        assert len(peers.lookups) == 1 and not peers.pins
        assert all(not plan.kv_loads for plan in peers.plans)
        await eventually(lambda: peers.released == [peers.lookups[0].pin_id])  # let go
    finally:
        await shutdown()


async def test_keepalives_are_published(nats_url, monkeypatch):
    from services.scheduler import service as service_module
    monkeypatch.setattr(service_module, "KEEPALIVE_INTERVAL_S", 0.05)
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        await eventually(lambda: len(peers.keepalives) >= 2)
        assert set(peers.keepalives) == {"s1"}
    finally:
        await shutdown()


async def test_a_restarted_kvstore_drops_the_old_pins(nats_url):
    service, peers, shutdown = await running(nats_url, "answers", max_num_seqs=1)
    try:
        first, second = prompt_of(80_000), prompt_of(90_000)
        peers.hold(first)
        peers.hold(second)
        await submit(peers.bus, "long", prompt_of(95_000, 5), max_tokens=40)
        await submit(peers.bus, "e", first)  # waits behind "long", with a pin of store-1
        assert service.core.requests["e"].tier_hit.store_id == "store-1"
        peers.store_id = peers.worker_store_id = "store-2"  # the kvstore restarted
        await service._ping_worker()  # the worker re-attached to it, and says so
        await submit(peers.bus, "f", second)
        assert service.core.requests["e"].tier_hit is None
        assert service.core.requests["f"].tier_hit.store_id == "store-2"
        await eventually(lambda: len(tokens_of(peers, "f")) == 3, timeout_s=10)
        assert tokens_of(peers, "e") == expected_tokens("e", len(first), 3)
    finally:
        await shutdown()


async def test_a_hit_of_another_kvstore_than_the_workers_is_recomputed(nats_url):
    """The kvstore restarted and the worker has not re-attached yet: the new kvstore's
    slots mean nothing to it, so the hit is let go and the request computes its prompt."""
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        prompt = prompt_of(85_000)
        peers.hold(prompt)
        peers.store_id = "store-2"
        await submit(peers.bus, "k", prompt)
        await eventually(lambda: len(tokens_of(peers, "k")) == 3)
        assert tokens_of(peers, "k") == expected_tokens("k", len(prompt), 3)
        assert all(not plan.kv_loads for plan in peers.plans)
        await eventually(lambda: peers.released == [peers.lookups[0].pin_id])
        assert peers.outputs["k"][0].num_cached_tokens == 0
    finally:
        await shutdown()


async def test_a_worker_that_attaches_to_its_kvstore_later_is_learned_from_its_pings(nats_url):
    """A worker attached by the scheduler before it reached its kvstore (started first,
    or restarted): its WorkerInfo names none; its pings do once it has, and from then on
    the scheduler looks prompts up and stores blocks."""
    peers_first = {"worker_info_has_kv": False, "worker_store_id": ""}
    service, peers, shutdown = await running(nats_url, "answers", _peers=peers_first)
    try:
        assert not service.kv.namespace  # the null connector
        peers.worker_store_id = "store-1"
        await eventually(lambda: service.kv.namespace == NAMESPACE, timeout_s=5)
        prompt = prompt_of(87_000)
        peers.hold(prompt)
        await submit(peers.bus, "m", prompt)
        await eventually(lambda: len(tokens_of(peers, "m")) == 3)
        assert peers.outputs["m"][0].num_cached_tokens == 24
        assert tokens_of(peers, "m") == expected_tokens("m", len(prompt), 3)
        assert isinstance(service.core.kv, KvConnector) and service.core.kv is service.kv
    finally:
        await shutdown()


async def test_an_abort_during_the_lookup_releases_the_pin_and_runs_nothing(nats_url):
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        prompt = prompt_of(100_000)
        peers.hold(prompt)
        peers.lookup_delay_s = 1.0  # the abort comes meanwhile, even on a loaded machine
        submitted = asyncio.create_task(submit(peers.bus, "g", prompt))
        await eventually(lambda: peers.lookups)
        await peers.bus.request(SUBJECTS.scheduler_abort("s1"), AbortRequest(request_ids=["g"]),
                                Empty)
        await submitted
        await eventually(lambda: peers.released == [peers.lookups[0].pin_id])
        assert "g" not in service.core.requests and not peers.plans
    finally:
        await shutdown()


async def test_a_pin_past_its_deadline_is_a_miss_and_let_go(nats_url, monkeypatch):
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        prompt = prompt_of(110_000)
        peers.hold(prompt, tier="disk")  # a disk hit: pinned by a second call
        monkeypatch.setattr(kv_client, "PIN_TIMEOUT_S", 0.2)
        peers.pin_delay_s = 2.0  # past PIN_TIMEOUT_S
        took = await submit(peers.bus, "h", prompt)
        assert took < 1.5
        await eventually(lambda: len(tokens_of(peers, "h")) == 3)
        assert tokens_of(peers, "h") == expected_tokens("h", len(prompt), 3)
        assert all(not plan.kv_loads for plan in peers.plans)
        await eventually(lambda: peers.released == [peers.pins[0].pin_id])
    finally:
        await shutdown()


async def test_a_request_keeps_its_place_in_line_through_its_lookup(nats_url):
    service, peers, shutdown = await running(nats_url, "answers", max_num_seqs=1)
    try:
        # long enough to run to the end of the test (the fake worker's steps take ~1 ms each: 60
        # tokens could end before "first"'s lookup, and "first" would be admitted)
        await submit(peers.bus, "long", prompt_of(120_000, 5), max_tokens=240)
        peers.lookup_delay_s = 0.03
        first = asyncio.create_task(submit(peers.bus, "first", prompt_of(130_000)))
        await eventually(lambda: len(peers.lookups) == 2)  # "long"'s, then "first"'s
        await submit(peers.bus, "second", [1, 2, 3])  # nothing to look up: queued at once
        await first
        assert [r.request_id for r in service.core.waiting] == ["first", "second"]
    finally:
        await shutdown()


async def test_a_slow_kvstore_is_not_left_alone(nats_url, monkeypatch):
    """Lookups that queue past their deadline at a kvstore that answers others meanwhile
    are misses, but do not make the client leave the kvstore alone (only silence does)."""
    # 0.3 s or more between an answer and its deadline, either way: what a loaded
    # two-core machine may add to a round trip stays well inside it
    monkeypatch.setattr(kv_client, "LOOKUP_TIMEOUT_S", 0.8)
    monkeypatch.setattr(kv_client, "LOOKUP_QUEUE_ALLOWANCE_S", 0.0)
    # left alone wrongly, it would still be when "after" comes
    monkeypatch.setattr(kv_client, "SILENT_BACKOFF_S", 30.0)
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        peers.lookup_delay_s = 0.5  # answered in turn: the first at 0.5 s, the rest late
        prompts = {f"s{i}": prompt_of(140_000 + 1_000 * i) for i in range(6)}
        for prompt in prompts.values():
            peers.hold(prompt)
        await asyncio.gather(*(submit(peers.bus, rid, p) for rid, p in prompts.items()))
        for request_id, prompt in prompts.items():
            await eventually(lambda rid=request_id: len(tokens_of(peers, rid)) == 3)
            assert tokens_of(peers, request_id) == expected_tokens(request_id, len(prompt), 3)
        assert peers.outputs["s0"][0].num_cached_tokens == 24
        assert sum(peers.outputs[rid][0].num_cached_tokens == 0 for rid in prompts) >= 4
        await eventually(lambda: len(peers.lookups) == 6)
        peers.lookup_delay_s = 0.0
        await submit(peers.bus, "after", prompt_of(150_000))
        await eventually(lambda: len(peers.lookups) == 7)  # asked, not skipped for 2 s
    finally:
        await shutdown()


async def test_lookups_queued_behind_others_get_more_time(nats_url, monkeypatch):
    """The kvstore answers lookups in turn: the deadline grows with the lookups in flight,
    so a burst's last lookup is still a hit."""
    # 0.4 s between each answer and its deadline (without the allowance all but the first
    # would be 0.2 s or more late): what a loaded machine adds stays well inside it
    monkeypatch.setattr(kv_client, "LOOKUP_TIMEOUT_S", 1.0)
    monkeypatch.setattr(kv_client, "LOOKUP_QUEUE_ALLOWANCE_S", 0.6)
    service, peers, shutdown = await running(nats_url, "answers")
    try:
        peers.lookup_delay_s = 0.6  # the k-th answered at (k + 1) x 0.6 s, due by 1 + k x 0.6
        prompts = {f"q{i}": prompt_of(160_000 + 1_000 * i) for i in range(5)}
        for prompt in prompts.values():
            peers.hold(prompt)
        await asyncio.gather(*(submit(peers.bus, rid, p) for rid, p in prompts.items()))
        for request_id in prompts:
            await eventually(lambda rid=request_id: len(tokens_of(peers, rid)) == 3)
        assert [peers.outputs[rid][0].num_cached_tokens for rid in prompts] == [24] * 5
    finally:
        await shutdown()
