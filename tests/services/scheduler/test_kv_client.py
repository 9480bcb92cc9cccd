"""The scheduler's kvstore client against a real kvstore (KvStoreService in this process,
with a host and a disk tier) over a real nats-server: host hits are pinned by the lookup
(one round trip), disk hits take a second call, every pin not used is let go, and the
tokens of each block confirm it."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.kvstore.config import KvStoreConfig
from services.kvstore.disk_tier import DiskTier
from services.kvstore.metrics import KvStoreMetrics
from services.kvstore.service import KvStoreService
from services.scheduler import kv_client as kv_client_module
from services.scheduler.kv_client import KvClient
from services.scheduler.intake import PrefixQuery
from services.scheduler.tiering import TierSpeeds
from shared.bus import Bus
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvCommitRequest, KvLayout, KvPinRequest,
)
from shared.subjects import Subjects

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("unhurried_kvstore_calls")]

SUBJECTS = Subjects()
NODE = "client-test"
BLOCK_SIZE = 4
LAYOUT = KvLayout(weights_version="w", dtype="float32", num_layers=1, block_size=BLOCK_SIZE,
                  num_kv_heads=1, head_dim=4)
SLOT_NBYTES = 2 * BLOCK_SIZE * 4 * 4  # 128
NUM_SLOTS = 16  # pins hold at most 8


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def tokens(i: int) -> list[int]:
    return [i * 10 + k for k in range(BLOCK_SIZE)]


def prompt(blocks: list[int]) -> list[int]:
    """A request's tokens: the blocks', then one more (its last block is never a hit)."""
    return [t for i in blocks for t in tokens(i)] + [1]


class Setup:
    def __init__(self, service: KvStoreService, bus: Bus, client: KvClient, namespace: str) -> None:
        self.service, self.bus, self.client, self.namespace = service, bus, client, namespace
        self.pin_requests: list[KvPinRequest] = []

    @property
    def host(self):
        return self.service.store.namespaces[self.namespace].host

    def put(self, blocks: list[int]) -> None:
        """Commit blocks to the host tier, as a worker would."""
        store = self.service.store
        slots = store.reserve(self.namespace, "worker", len(blocks), now=time.monotonic())
        assert len(slots) == len(blocks)
        store.commit(KvCommitRequest(
            namespace=self.namespace, owner_id="worker", store_id=self.service.store_id,
            block_hashes=[h(i) for i in blocks], slot_ids=slots,
            token_ids=[token for i in blocks for token in tokens(i)], block_size=BLOCK_SIZE),
            now=time.monotonic())

    async def find(self, blocks: list[int], request_tokens: list[int] | None = None):
        return await self.client.find_hit(PrefixQuery([h(i) for i in blocks], 0),
                                          request_tokens or prompt(blocks))


@pytest.fixture
async def setup(nats_url, tmp_path):
    disk = DiskTier(tmp_path / "disk", 1 << 20)
    for i in (1, 2, 3, 4):  # every block is on disk; tests put some on the host tier too
        disk.write(LAYOUT.namespace, h(i), tokens(i), memoryview(bytes([i]) * SLOT_NBYTES))
    disk.scan()
    (tmp_path / "shm").mkdir()
    config = KvStoreConfig(nats_url=nats_url, node_id=NODE, kv_shm_dir=str(tmp_path / "shm"),
                           kv_host_memory=str(NUM_SLOTS * SLOT_NBYTES),
                           kv_disk_dir=str(tmp_path / "disk"), kv_disk_size="1MiB")
    kv_bus = await Bus.connect(nats_url, "kvstore")
    service = KvStoreService(config, kv_bus, disk, KvStoreMetrics(), tmp_path / "shm")
    await service.start()
    await kv_bus.flush()  # its subscriptions answer before another connection asks
    bus = await Bus.connect(nats_url, "scheduler")
    attached = await bus.request(SUBJECTS.kvstore(NODE, "attach"), KvAttachRequest(
        owner_id="worker", layout=LAYOUT, itemsize=4), KvAttachReply)
    client = KvClient(bus, SUBJECTS, owner_id="s1", node_id=NODE, namespace=attached.namespace,
                      block_bytes=SLOT_NBYTES, block_size=BLOCK_SIZE, speeds=TierSpeeds())
    state = Setup(service, bus, client, attached.namespace)

    async def on_pin(request: KvPinRequest) -> None:  # beside the kvstore: sees every pin
        state.pin_requests.append(request)

    await bus.subscribe(SUBJECTS.kvstore(NODE, "pin"), KvPinRequest, on_pin)
    yield state
    await bus.close()
    await kv_bus.close()
    await service.close()


async def eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_host_hit_is_pinned_by_the_lookup_alone(setup):
    setup.put([1, 2, 3])
    hit = await setup.find([1, 2, 3])
    assert hit is not None and hit.tiers == ("host",) * 3
    assert list(hit.slot_ids) == [setup.host.get(h(i)).slot_id for i in (1, 2, 3)]
    assert setup.host.pinned_slots(hit.pin_id) == list(hit.slot_ids)
    await asyncio.sleep(0.05)
    assert setup.pin_requests == []  # one round trip
    await setup.client.release([hit.pin_id])
    await eventually(lambda: setup.host.num_pinned == 0)


async def test_disk_blocks_wanted_release_the_lookups_pin_and_pin_again(setup):
    setup.put([1, 2])  # 1 and 2 on the host tier, 3 and 4 only on disk
    hit = await setup.find([1, 2, 3, 4])
    assert hit is not None and hit.tiers == ("host", "host", "disk", "disk")
    (pin_request,) = setup.pin_requests
    assert pin_request.pin_id == hit.pin_id
    # the lookup pinned 1 and 2 under another id, released: only the hit's pin is left
    await eventually(lambda: setup.host.pin_ids_of("s1") == [hit.pin_id])
    assert setup.host.num_pinned == 4
    await setup.client.release([hit.pin_id])
    await eventually(lambda: setup.host.num_pinned == 0)


async def test_only_the_blocks_whose_tokens_match_are_used(setup):
    setup.put([1, 2, 3])
    request_tokens = prompt([1, 2, 3])
    request_tokens[BLOCK_SIZE + 1] = 999_999  # block 2 differs: same hash, other tokens
    hit = await setup.find([1, 2, 3], request_tokens)
    assert hit is not None and len(hit.slot_ids) == 1
    wrong_first = prompt([1])
    wrong_first[0] = 999_999
    assert await setup.find([1], wrong_first) is None
    await setup.client.release([hit.pin_id])
    await eventually(lambda: setup.host.num_pinned == 0)  # the unconfirmed pin was let go


async def test_a_hit_not_worth_loading_lets_the_lookups_pin_go(setup):
    setup.client.speeds.prefill_tokens_per_s = 1e12  # recompute measured faster
    setup.client.speeds.host_load_bytes_per_s = 1.0
    setup.put([1, 2])
    assert await setup.find([1, 2]) is None
    await eventually(lambda: setup.host.num_pinned == 0 and not setup.host.pin_ids_of("s1"))
    assert setup.pin_requests == []


async def test_at_the_pin_cap_the_lookups_shorter_pin_is_used(setup):
    setup.put([1, 2, 3, 4, 5, 6, 7, 8])
    setup.put([9, 10])
    first = await setup.find([1, 2, 3, 4, 5, 6, 7])  # 7 of the 8 slots pins may hold
    hit = await setup.find([8, 9, 10])
    assert hit is not None and len(hit.slot_ids) == 1  # block 8: the last slot of room
    await asyncio.sleep(0.05)
    assert setup.pin_requests == []  # a pin would meet the same cap
    assert await setup.find([9, 10]) is None  # no room at all
    await setup.client.release([first.pin_id, hit.pin_id])
    await eventually(lambda: setup.host.num_pinned == 0)


async def test_a_lookup_past_its_deadline_lets_go_of_what_it_pinned(setup, monkeypatch):
    monkeypatch.setattr(kv_client_module, "LOOKUP_TIMEOUT_S", 1e-6)
    setup.put([1, 2])
    assert await setup.find([1, 2]) is None
    # the kvstore pinned the run after the client gave up on it; the release follows
    registry = setup.service.metrics.registry
    await eventually(lambda: registry.get_sample_value(
        "flotilla_kvstore_pinned_total", {"tier": "host"}) == 2)
    await eventually(lambda: setup.host.num_pinned == 0 and not setup.host.pin_ids_of("s1"))
