"""The tiered KV store end to end (docs/kvstore.md): real nats-server, kvstore, worker,
scheduler, tokenizer and gateway processes, SmolLM2, greedy.

The worker's cache is small (68 blocks of 16 tokens), so a ~1,000-token prompt (63
blocks) evicts the one before it; the kvstore keeps them (host RAM, and a disk tier under
tmp). Every run with tier hits must give exactly the uncached run's text. The tests run
in order on one stack and share two prompts: a worker restart, a kvstore killed mid-load
and restarted, a block file damaged on disk.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
import urllib.request
from pathlib import Path

import httpx
import pytest

from cli.stack import free_port
from services.kvstore.block_file import read_header
from shared.bus import Bus
from shared.errors import FlotillaError
from shared.messages import Empty, HealthReply
from shared.kv_messages import KvStatsReply
from shared.subjects import Subjects
from tests.integration.conftest import start_stack, wait_for

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16
PROMPT_TOKENS = 1_000
NUM_FULL_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK_SIZE  # the last token's block is always computed
MAX_TOKENS = 4


def prompt(seed: int) -> list[int]:
    """A ~1,000-token prompt of its own (token ids: no tokenizer round trip, exact length)."""
    rng = random.Random(seed)
    return [rng.randrange(1_000, 40_000) for _ in range(PROMPT_TOKENS)]


def metric(url: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus metric's samples (those with ``label``, e.g. 'tier="disk"');
    -1 while nothing serves them."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return -1.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and label in line)


class Tiers:
    """The stack and what the tests read from it."""

    def __init__(self, stack, model_name: str, disk_dir: Path, kv_metrics_port: int) -> None:
        self.stack, self.model_name, self.disk_dir = stack, model_name, disk_dir
        self.kv_metrics_url = f"http://127.0.0.1:{kv_metrics_port}/metrics"

    def complete(self, token_ids: list[int]) -> tuple[str, int]:
        """Greedy completion: (text, cached prompt tokens)."""
        response = httpx.post(self.stack.base_url + "/v1/completions", timeout=120, json={
            "model": self.model_name, "prompt": token_ids, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        body = response.json()
        return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    def tier_hits(self) -> float:
        return metric(self.stack.base_url + "/metrics", "flotilla_prefix_cache_tier_hits_total")

    def kv_metric(self, name: str, label: str = "") -> float:
        return metric(self.kv_metrics_url, name, label)

    def wait_stored(self, tier: str, at_least: float) -> None:
        assert wait_for(lambda: self.kv_metric("flotilla_kvstore_blocks", f'tier="{tier}"')
                        >= at_least, 20), f"blocks did not reach the {tier} tier"

    def scheduler_attached_to_the_worker(self) -> bool:
        """The scheduler has attached the worker running now (after a restart it notices
        within about a second while idle; the gateway's /health may say ready before)."""

        async def ask() -> bool:
            subjects = Subjects(self.stack.options.namespace)
            bus = await Bus.connect(self.stack.nats_url, name="kvstore-tier-test")
            try:
                scheduler = await bus.request(subjects.health("scheduler"), Empty(),
                                              HealthReply, timeout=2)
                worker = await bus.request(subjects.worker_ping("0"), Empty(), HealthReply,
                                           timeout=2)
            except FlotillaError:
                return False
            finally:
                await bus.close()
            return scheduler.detail.get("worker_id") == worker.instance_id

        return asyncio.run(ask())

    def worker_attached_to_the_kvstore(self) -> bool:
        """The worker maps the arena of the kvstore running now (it re-attaches within
        ~2 s of a kvstore restart), and the scheduler knows (from its pings: until then it
        lets go of the hits, which the worker could not load)."""

        async def ask() -> bool:
            subjects = Subjects(self.stack.options.namespace)
            bus = await Bus.connect(self.stack.nats_url, name="kvstore-tier-test")
            try:
                stats = await bus.request(subjects.kvstore(self.stack.options.kv_node_id,
                                                           "stats"), Empty(), KvStatsReply,
                                          timeout=2)
                health = await bus.request(subjects.worker_ping("0"), Empty(), HealthReply,
                                           timeout=2)
                scheduler = await bus.request(subjects.health("scheduler"), Empty(),
                                              HealthReply, timeout=2)
            except FlotillaError:
                return False
            finally:
                await bus.close()
            return health.detail.get("kv_store_id") == stats.store_id == \
                scheduler.detail.get("worker_kv_store_id")

        return asyncio.run(ask())

    def kvstore_answers(self) -> bool:
        async def ask() -> bool:
            bus = await Bus.connect(self.stack.nats_url, name="kvstore-tier-test")
            try:
                await bus.request(Subjects(self.stack.options.namespace).kvstore(
                    self.stack.options.kv_node_id, "stats"), Empty(), KvStatsReply, timeout=1)
            except FlotillaError:
                return False
            finally:
                await bus.close()
            return True

        return asyncio.run(ask())

    def restart_kvstore(self) -> None:
        self.stack.stop_service("kvstore", signal.SIGKILL)
        self.stack.start_service("kvstore")
        assert wait_for(self.worker_attached_to_the_kvstore, 30), "the worker did not re-attach"

    def disk_files(self) -> list[Path]:
        return [path for path in self.disk_dir.rglob("*") if path.is_file()
                and not path.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def tiers(tmp_path_factory, model_name):
    disk_dir = tmp_path_factory.mktemp("kv-disk")
    kv_metrics_port = free_port()
    stack = start_stack(
        tmp_path_factory.mktemp("kvstore-tier-logs"), kv_node_id=f"kvtest{random.randrange(1 << 30)}",
        service_args={
            # 68 blocks: a 1,000-token prompt takes 63, so the next one evicts it
            "worker": ["--kv-cache-memory", "48MiB"],
            "kvstore": ["--kv-host-memory", "256MiB", "--kv-disk-dir", str(disk_dir),
                        "--kv-disk-size", "1GiB", "--metrics-port", str(kv_metrics_port)],
        })
    yield Tiers(stack, model_name, disk_dir, kv_metrics_port)
    stack.stop()


@pytest.fixture(scope="module")
def references() -> dict[int, str]:
    """Uncached greedy text per prompt seed, filled by the tests in order."""
    return {}


FIRST, SECOND = 1, 2  # the two prompts the tests share (each evicts the other)


def test_a_prefix_evicted_from_the_worker_hits_the_host_tier(tiers, references):
    for seed in (FIRST, SECOND):  # the second evicts the first from the worker's cache
        references[seed], cached = tiers.complete(prompt(seed))
        assert cached == 0
    tiers.wait_stored("host", 2 * NUM_FULL_BLOCKS)
    tier_hits_before = tiers.tier_hits()

    text, cached = tiers.complete(prompt(FIRST))

    assert text == references[FIRST]
    assert cached >= 0.9 * NUM_FULL_BLOCKS * BLOCK_SIZE, cached
    # most of it from the host tier (the worker keeps the first few blocks: tails go first)
    assert wait_for(lambda: tiers.tier_hits() - tier_hits_before
                    >= 0.8 * NUM_FULL_BLOCKS * BLOCK_SIZE, 10)


def test_a_restarted_worker_keeps_the_hits(tiers, references):
    tiers.stack.stop_service("worker", signal.SIGKILL)
    tiers.stack.start_service("worker")
    tiers.stack.wait_ready(120)
    assert wait_for(tiers.scheduler_attached_to_the_worker, 10)
    assert wait_for(tiers.worker_attached_to_the_kvstore, 30)
    tier_hits_before = tiers.tier_hits()

    text, cached = tiers.complete(prompt(SECOND))  # an empty cache: all from the kvstore

    assert text == references[SECOND]
    assert cached >= 0.9 * NUM_FULL_BLOCKS * BLOCK_SIZE, cached
    assert wait_for(lambda: tiers.tier_hits() - tier_hits_before >= cached, 10), (
        tier_hits_before, tiers.tier_hits())


def test_the_kvstore_killed_mid_load_leaves_requests_correct(tiers, references):
    """Requests in flight while the kvstore dies (one with a tier hit, one arriving after
    the kill) end with their uncached text; a request that comes as soon as the kvstore
    is back, when the worker may not have re-attached to it yet (its slots mean nothing
    to the worker), is recomputed or loaded, never failed; then hits work again, from
    the disk tier (the index rebuilt from the files)."""
    outcomes: dict[int, tuple[str, int]] = {}

    def run(seed: int) -> None:
        outcomes[seed] = tiers.complete(prompt(seed))

    with_hit = threading.Thread(target=run, args=(FIRST,))  # evicted by SECOND just now
    with_hit.start()
    time.sleep(0.2)
    tiers.stack.stop_service("kvstore", signal.SIGKILL)
    after_the_kill = threading.Thread(target=run, args=(SECOND,))
    after_the_kill.start()
    for thread in (with_hit, after_the_kill):
        thread.join(180)
        assert not thread.is_alive()
    assert {seed: text for seed, (text, _) in outcomes.items()} == {
        FIRST: references[FIRST], SECOND: references[SECOND]}

    tiers.stack.start_service("kvstore")
    assert wait_for(tiers.kvstore_answers, 30)
    # evicted by SECOND just now; at once, maybe before the worker re-attached
    text, _ = tiers.complete(prompt(FIRST))
    assert text == references[FIRST]

    assert wait_for(tiers.worker_attached_to_the_kvstore, 30), "the worker did not re-attach"
    text, cached = tiers.complete(prompt(SECOND))  # evicted by FIRST just now
    assert text == references[SECOND]
    assert cached >= 0.9 * NUM_FULL_BLOCKS * BLOCK_SIZE, "no tier hits after the restart"


def test_a_flipped_byte_on_disk_is_detected_and_recomputed(tiers, references):
    tokens = prompt(FIRST)  # evicted by SECOND; on disk since the first test
    damaged_block = 30
    wanted = tokens[damaged_block * BLOCK_SIZE:(damaged_block + 1) * BLOCK_SIZE]
    path = next(path for path in tiers.disk_files() if block_tokens(path) == wanted)
    flip_a_payload_byte(path)
    tiers.restart_kvstore()  # only the disk copy is left
    corrupt_before = tiers.kv_metric("flotilla_kvstore_corrupt_blocks_total")

    text, cached = tiers.complete(tokens)

    assert text == references[FIRST]
    assert cached == damaged_block * BLOCK_SIZE  # the run of hits ends at the damaged block
    assert tiers.kv_metric("flotilla_kvstore_corrupt_blocks_total") == corrupt_before + 1


def block_tokens(path: Path) -> list[int] | None:
    try:
        header, _ = read_header(path)
        with open(path, "rb") as f:
            f.seek(header.header_nbytes - 4 * header.num_tokens)
            raw = f.read(4 * header.num_tokens)
    except Exception:  # noqa: BLE001 - a file being replaced
        return None
    return [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]


def flip_a_payload_byte(path: Path) -> None:
    header, _ = read_header(path)
    with open(path, "r+b") as f:
        f.seek(header.header_nbytes + header.payload_nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
