"""The worker service with a kvstore over a real nats-server: attach (advertised in WorkerInfo
and health), reservations, commits of a step's stores, keepalives; a kvstore absent at start
is attached once it appears; a restarted kvstore (new store id, new arena) is re-attached and
the loads planned meanwhile are computed instead, never read from the old arena.

The kvstore here is a stand-in speaking the contract (shared/messages.py, Kv*), with a real
arena file; tests with the real process live with the kvstore."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import services.worker.kv_upkeep as kv_upkeep
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from services.worker.service import WorkerService
from shared.bus import Bus
from shared.kv_arena import KvArena
from shared.messages import (
    Empty, HealthReply, KvLoad, KvStoreRun, NewRequestData, SamplingParams, ScheduledRequest,
    StepPlan, StepResult, WorkerInfo,
)
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvCommitRequest, KvKeepAlive, KvReserveReply,
    KvReserveRequest,
)
from shared.models import ModelFiles, weights_version
from shared.subjects import Subjects
from tests.nats_server import started_nats_server
from tests.services.worker.kv_arenas import committed_blocks

pytestmark = pytest.mark.integration

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None)
NODE = "node-a"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    server = started_nats_server(tmp_path_factory.mktemp("nats") / "nats.log")
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(path, safe_serialization=True)
    return build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB"),
                       ModelFiles(name="tiny-llama", path=path))


class StandInKvStore:
    """Attach, reserve, commit and keepalive as the kvstore answers them."""

    def __init__(self, bus: Bus, namespace: str, arena_dir, store_id: str) -> None:
        self.bus, self.subjects, self.arena_dir = bus, Subjects(namespace), arena_dir
        self.store_id = store_id
        self.arena: KvArena | None = None
        self.next_slot = 0
        self.commits: list[KvCommitRequest] = []
        self.keepalives: list[str] = []

    async def start(self) -> None:
        await self.bus.serve(self.subjects.kvstore(NODE, "attach"), KvAttachRequest, self.attach)
        await self.bus.serve(self.subjects.kvstore(NODE, "reserve"), KvReserveRequest,
                             self.reserve)
        await self.bus.subscribe(self.subjects.kvstore(NODE, "commit"), KvCommitRequest,
                                 self.commit)
        await self.bus.subscribe(self.subjects.kvstore(NODE, "keepalive"), KvKeepAlive,
                                 self.keepalive)

    async def attach(self, request: KvAttachRequest) -> KvAttachReply:
        slot_nbytes = request.itemsize
        for size in request.layout.slot_shape:
            slot_nbytes *= size
        path = self.arena_dir / f"{request.layout.namespace}.arena"
        if self.arena is None or self.arena.store_id != self.store_id:
            self.arena = KvArena.create(path, 64, slot_nbytes, self.store_id)
        return KvAttachReply(store_id=self.store_id, node_id=NODE,
                             namespace=request.layout.namespace, arena_path=str(path),
                             num_slots=64, slot_nbytes=slot_nbytes)

    async def reserve(self, request: KvReserveRequest) -> KvReserveReply:
        slot_ids = list(range(self.next_slot, min(64, self.next_slot + request.num_slots)))
        self.next_slot += len(slot_ids)
        return KvReserveReply(store_id=self.store_id, slot_ids=slot_ids)

    async def commit(self, request: KvCommitRequest) -> None:
        self.commits.append(request)

    async def keepalive(self, message: KvKeepAlive) -> None:
        self.keepalives.append(message.owner_id)

    async def stop(self) -> None:
        for verb in ("attach", "reserve", "commit", "keepalive"):
            await self.bus.unsubscribe(self.subjects.kvstore(NODE, verb))


def layout_of(runner: ModelRunner):
    return runner.kv_layout(weights_version(runner.model_path, runner.seed))


async def eventually(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


@pytest.fixture
def fast_upkeep(monkeypatch):
    monkeypatch.setattr(kv_upkeep, "KV_KEEPALIVE_S", 0.2)


async def start_worker(runner: ModelRunner, nats_url: str, namespace: str):
    runner.reset()
    runner.attach_kv(None)
    config = WorkerConfig(nats_url=nats_url, namespace=namespace, kv_node_id=NODE,
                          device="cpu", instance_id=f"worker-{namespace}")
    bus = await Bus.connect(nats_url, name="worker")
    service = WorkerService(config, bus, runner, ThreadPoolExecutor(max_workers=1))
    await service.start()
    return service, bus


async def test_attach_reserve_commit_keepalive(runner, nats_url, tmp_path, fast_upkeep):
    namespace = "kvsvc1"
    client = await Bus.connect(nats_url, name="kvstore")
    kvstore = StandInKvStore(client, namespace, tmp_path, "store-1")
    await kvstore.start()
    await client.flush()  # the worker's one attach at start must find it (WorkerInfo says so)
    service, bus = await start_worker(runner, nats_url, namespace)
    try:
        subjects = Subjects(namespace)
        info = await client.request(subjects.worker_attach("0"), Empty(), WorkerInfo)
        assert info.kv_node_id == NODE and info.kv_namespace == layout_of(runner).namespace
        health = await client.request(subjects.worker_ping("0"), Empty(), HealthReply)
        assert health.detail["kv_attached"] and health.detail["kv_num_free_slots"] > 0
        prompt = list(range(1, 36))  # two full blocks of 16
        plan = StepPlan(0, [NewRequestData("r", prompt, GREEDY, [4, 7, 9])],
                        [ScheduledRequest("r", len(prompt))], worker_id=service.config.instance_id,
                        kv_stores=[KvStoreRun("r", 0, [4, 7], [b"h0", b"h1"])])
        result = await client.request(subjects.worker_step("0"), plan, StepResult)
        assert result.request_ids == ["r"]
        assert await eventually(lambda: kvstore.commits)
        (commit,) = kvstore.commits
        assert commit.store_id == "store-1" and commit.owner_id == service.config.instance_id
        blocks = committed_blocks(commit)
        assert [(block_hash, token_ids) for block_hash, _, token_ids in blocks] == [
            (b"h0", prompt[:16]), (b"h1", prompt[16:32])]
        slots = torch.from_numpy(kvstore.arena.slots()).view(torch.float32) \
            .view(64, *runner.kv_layout("").slot_shape)
        assert torch.equal(slots[blocks[1][1]], runner.kv_cache[:, :, 7])
        assert await eventually(lambda: service.config.instance_id in kvstore.keepalives)
    finally:
        service.kv_upkeep.stop()
        await bus.close()
        await client.close()


async def test_a_kvstore_absent_at_start_then_restarted(runner, nats_url, tmp_path,
                                                        fast_upkeep):
    namespace = "kvsvc2"
    service, bus = await start_worker(runner, nats_url, namespace)  # no kvstore yet
    client = await Bus.connect(nats_url, name="kvstore")
    subjects = Subjects(namespace)
    try:
        info = await client.request(subjects.worker_attach("0"), Empty(), WorkerInfo)
        assert info.kv_namespace == "" and info.kv_node_id == ""
        plan = StepPlan(0, [NewRequestData("r", list(range(1, 20)), GREEDY, [0, 1], 16)],
                        [ScheduledRequest("r", 3)], kv_loads=[KvLoad([0], [0])])
        # a load with no kvstore attached: computed instead (a longer step, no failure)
        result = await client.request(subjects.worker_step("0"), plan, StepResult)
        assert result.request_ids == ["r"]

        kvstore = StandInKvStore(client, namespace, tmp_path, "store-1")
        await kvstore.start()
        # attached first, then its slots reserved (kv_upkeep._attach): wait for both
        assert await eventually(lambda: runner.kv.offload is not None
                                and runner.kv.offload.slot_pool.num_free > 0)
        first = runner.kv.offload
        assert first.store_id == "store-1"

        service.kv_upkeep.stop()  # the restart happens between two upkeep rounds
        kvstore.store_id = "store-2"  # restarted: a new arena file at the same path
        await client.request(subjects.kvstore(NODE, "attach"), KvAttachRequest(
            owner_id="someone", layout=layout_of(runner), itemsize=4), KvAttachReply)
        # a load planned on the new kvstore before the worker noticed: never read from
        # the old arena, computed instead
        await client.request(subjects.worker_attach("0"), Empty(), WorkerInfo)
        plan = StepPlan(0, [NewRequestData("r", list(range(1, 20)), GREEDY, [0, 1], 16)],
                        [ScheduledRequest("r", 3)], kv_loads=[KvLoad([0], [0])])
        result = await client.request(subjects.worker_step("0"), plan, StepResult)
        assert result.request_ids == ["r"] and result.kv_load_bytes == 0
        assert first.num_recomputed == 1 and first.num_loaded == 0
        service.kv_upkeep.start_upkeep()
        assert await eventually(lambda: runner.kv.offload is not None
                                and runner.kv.offload.store_id == "store-2")
        info = await client.request(subjects.worker_attach("0"), Empty(), WorkerInfo)
        assert info.kv_node_id == NODE
    finally:
        service.kv_upkeep.stop()
        await bus.close()
        await client.close()
