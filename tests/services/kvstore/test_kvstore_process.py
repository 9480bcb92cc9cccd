"""The kvstore as a process, for real: a nats-server and ``python -m services.kvstore``;
the test plays the worker (attach, reserve, write into the mapped arena, commit) and the
scheduler (lookup, pin, read back, release)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cli.stack import free_port
from shared.bus import Bus
from shared.errors import FlotillaError
from shared.kv_arena import KvArena
from shared.messages import Empty
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvBlockEvent, KvCommitRequest, KvKeepAlive, KvLayout,
    KvLookupReply, KvLookupRequest, KvPinReply, KvPinRequest, KvReleaseRequest, KvReserveReply,
    KvReserveRequest, KvStatsReply,
)
from shared.subjects import Subjects
from tests.nats_server import started_nats_server

pytestmark = pytest.mark.integration

SUBJECTS = Subjects()
LAYOUT = KvLayout(weights_version="test-weights", dtype="float32", num_layers=2, block_size=4,
                  num_kv_heads=2, head_dim=16)
ITEMSIZE = 4
SLOT_NBYTES = 2 * 2 * 4 * 2 * 16 * ITEMSIZE  # 2048
OWNER_TIMEOUT_S = 3.0  # the owners the tests keep alive may go a while between calls


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def block_bytes(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SLOT_NBYTES, dtype=np.uint8)


@pytest.fixture
def nats_url(tmp_path):
    server = started_nats_server(tmp_path / "nats.log")
    yield server.url
    server.stop()


class KvStoreProcess:
    """Starts ``python -m services.kvstore`` with a unique node id, and again after a kill."""

    def __init__(self, tmp_path: Path, nats_url: str, disk: bool) -> None:
        self.tmp_path = tmp_path
        self.nats_url = nats_url
        self.node_id = f"test-{os.getpid()}-{tmp_path.name[-12:].replace('_', '-')}"
        self.shm_dir = tmp_path / "shm"
        self.shm_dir.mkdir()
        self.disk_dir = tmp_path / "disk" if disk else None
        self.metrics_port = free_port()
        self.args = [sys.executable, "-m", "services.kvstore", "--nats-url", nats_url,
                     "--node-id", self.node_id, "--kv-shm-dir", str(self.shm_dir),
                     "--kv-host-memory", str(64 * SLOT_NBYTES),
                     "--owner-timeout-s", str(OWNER_TIMEOUT_S), "--event-interval-s", "0.02",
                     "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1"]
        if self.disk_dir is not None:
            self.args += ["--kv-disk-dir", str(self.disk_dir), "--kv-disk-size", "1MiB"]
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.tmp_path / f"kvstore-{self.starts}.log", "w")
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)

    def subject(self, verb: str) -> str:
        return SUBJECTS.kvstore(self.node_id, verb)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def kvstore_factory(tmp_path, nats_url):
    started = []

    def make(disk: bool) -> KvStoreProcess:
        kv = KvStoreProcess(tmp_path, nats_url, disk)
        kv.start()
        started.append(kv)
        return kv

    yield make
    for kv in started:
        kv.stop()


async def until(condition, timeout_s: float, what: str):
    """Poll ``condition`` (a function, plain or async) until it returns something true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_ready(bus: Bus, kv: KvStoreProcess) -> KvStatsReply:
    async def stats():
        try:
            return await bus.request(kv.subject("stats"), Empty(), KvStatsReply, timeout=0.5)
        except Exception:  # noqa: BLE001 - not up yet
            return None
    return await until(stats, 30, "the kvstore to answer")


async def attach(bus: Bus, kv: KvStoreProcess, owner: str) -> KvAttachReply:
    return await bus.request(kv.subject("attach"), KvAttachRequest(
        owner_id=owner, layout=LAYOUT, itemsize=ITEMSIZE), KvAttachReply)


async def store_blocks(bus: Bus, kv: KvStoreProcess, reply: KvAttachReply, arena: KvArena,
                       hashes: list[int]) -> list[int]:
    """The worker's part: reserve, write the bytes into the arena, commit."""
    reserved = await bus.request(kv.subject("reserve"), KvReserveRequest(
        namespace=reply.namespace, owner_id="worker", num_slots=len(hashes) + 1), KvReserveReply)
    assert reserved.store_id == reply.store_id and len(reserved.slot_ids) == len(hashes) + 1
    slots = arena.slots()
    for i, slot in zip(hashes, reserved.slot_ids):
        slots[slot] = block_bytes(i)
    del slots
    await bus.request(kv.subject("commit"), KvCommitRequest(
        namespace=reply.namespace, owner_id="worker", store_id=reply.store_id,
        block_hashes=[h(i) for i in hashes], slot_ids=reserved.slot_ids[:len(hashes)],
        token_ids=[i + j for i in hashes for j in range(4)], block_size=4,
        returned_slot_ids=reserved.slot_ids[len(hashes):]), Empty)
    return reserved.slot_ids[:len(hashes)]


async def pin(bus: Bus, kv: KvStoreProcess, namespace: str, pin_id: str, hashes: list[int],
              owner: str = "scheduler") -> KvPinReply:
    return await bus.request(kv.subject("pin"), KvPinRequest(
        namespace=namespace, owner_id=owner, pin_id=pin_id, block_hashes=[h(i) for i in hashes]),
        KvPinReply)


async def lookup(bus: Bus, kv: KvStoreProcess, namespace: str, hashes: list[int]) -> KvLookupReply:
    return await bus.request(kv.subject("lookup"), KvLookupRequest(
        namespace=namespace, block_hashes=[h(i) for i in hashes]), KvLookupReply)


def tier(stats: KvStatsReply, name: str):
    return next(t for t in stats.tiers if t.tier == name)


async def test_store_lookup_pin_read_back_and_restart_from_disk(kvstore_factory):
    kv = kvstore_factory(disk=True)
    bus = await Bus.connect(kv.nats_url, name="test")
    events: list[KvBlockEvent] = []

    async def on_event(event: KvBlockEvent) -> None:
        events.append(event)

    await bus.subscribe(SUBJECTS.kvstore_blocks, KvBlockEvent, on_event)
    try:
        await wait_ready(bus, kv)
        reply = await attach(bus, kv, "worker")
        assert reply.namespace == LAYOUT.namespace and reply.slot_nbytes == SLOT_NBYTES
        assert reply.num_slots == 64 and Path(reply.arena_path).parent == kv.shm_dir
        arena = KvArena.attach(reply.arena_path)
        assert arena.store_id == reply.store_id
        await store_blocks(bus, kv, reply, arena, [1, 2, 3])

        # lookup and pin from the host tier: the bytes read back are the bytes written
        found = await lookup(bus, kv, reply.namespace, [1, 2, 3, 4])
        assert found.tiers == ["host"] * 3
        pinned = await pin(bus, kv, reply.namespace, "p1", [1, 2, 3, 4])
        assert pinned.tiers == ["host"] * 3
        assert pinned.token_ids == [[i, i + 1, i + 2, i + 3] for i in (1, 2, 3)]
        for i, slot in zip((1, 2, 3), pinned.slot_ids):
            assert np.array_equal(arena.slots()[slot], block_bytes(i))
        stats = await bus.request(kv.subject("stats"), Empty(), KvStatsReply)
        assert tier(stats, "host").num_pinned == 3 and tier(stats, "host").num_blocks == 3
        await bus.request(kv.subject("release"), KvReleaseRequest(
            namespace=reply.namespace, owner_id="scheduler", pin_ids=["p1"]), Empty)

        # a lookup that pins: the same blocks in one round trip
        found = await bus.request(kv.subject("lookup"), KvLookupRequest(
            namespace=reply.namespace, block_hashes=[h(i) for i in (1, 2, 3, 4)],
            owner_id="scheduler", pin_id="p0"), KvLookupReply)
        assert found.tiers == ["host"] * 3
        assert found.slot_ids == pinned.slot_ids and found.token_ids == pinned.token_ids
        stats = await bus.request(kv.subject("stats"), Empty(), KvStatsReply)
        assert tier(stats, "host").num_pinned == 3
        with pytest.raises(FlotillaError) as error:  # a pin id in use
            await bus.request(kv.subject("lookup"), KvLookupRequest(
                namespace=reply.namespace, block_hashes=[h(1)], owner_id="scheduler",
                pin_id="p0"), KvLookupReply)
        assert error.value.status == 400
        await bus.request(kv.subject("release"), KvReleaseRequest(
            namespace=reply.namespace, owner_id="scheduler", pin_ids=["p0"]), Empty)

        # written through to disk, with events for both tiers
        async def on_disk():
            stats = await bus.request(kv.subject("stats"), Empty(), KvStatsReply)
            return tier(stats, "disk").num_blocks == 3 and stats
        stats = await until(on_disk, 10, "the disk writes")
        assert tier(stats, "host").num_pinned == 0
        # the disk writes may be announced in more than one event: wait for all three
        def disk_hashes() -> set[bytes]:
            return {bh for e in events if e.tier == "disk" for bh in e.stored_hashes}
        await until(lambda: disk_hashes() == {h(1), h(2), h(3)}, 5, "disk block events")
        assert {e.tier for e in events} == {"host", "disk"}
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        # counted by the writer thread after it indexed the block (and after the event
        # flush may have taken it): wait for the third block's bytes, not read it at once
        await until(lambda: kv.metric("flotilla_kvstore_written_bytes_total") > 3 * SLOT_NBYTES,
                    10, "the written bytes of all three blocks")
        old_arena = Path(reply.arena_path)
        arena.close()

        # kill -9 and start again: a new store, a new arena, the blocks found on disk
        os.kill(kv.process.pid, signal.SIGKILL)
        kv.process.wait()
        kv.start()
        await wait_ready(bus, kv)
        assert not old_arena.exists()  # the dead kvstore's arena was removed at start
        again = await attach(bus, kv, "worker")
        assert again.store_id != reply.store_id and again.arena_path != reply.arena_path
        found = await lookup(bus, kv, again.namespace, [1, 2, 3, 4])
        assert found.tiers == ["disk"] * 3
        pinned = await pin(bus, kv, again.namespace, "p2", [1, 2, 3])
        assert pinned.tiers == ["disk"] * 3 and pinned.store_id == again.store_id
        assert pinned.token_ids[2] == [3, 4, 5, 6]
        arena = KvArena.attach(again.arena_path)
        for i, slot in zip((1, 2, 3), pinned.slot_ids):
            assert np.array_equal(arena.slots()[slot], block_bytes(i))
        assert (await lookup(bus, kv, again.namespace, [1, 2, 3])).tiers == ["host"] * 3
        assert (await lookup(bus, kv, again.namespace, [1])).disk_read_bytes_per_s > 0
        await bus.request(kv.subject("release"), KvReleaseRequest(
            namespace=again.namespace, owner_id="scheduler", pin_ids=["p2"]), Empty)
        arena.close()

        # a flipped byte on disk: that block's pin misses, the file goes, the counter rises
        kv.process.kill()
        kv.process.wait()
        path = next(p for p in kv.disk_dir.rglob(h(2).hex()))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
        kv.start()
        await wait_ready(bus, kv)
        third = await attach(bus, kv, "worker")
        assert (await lookup(bus, kv, third.namespace, [1, 2, 3])).tiers == ["disk"] * 3
        pinned = await pin(bus, kv, third.namespace, "p3", [1, 2, 3])
        assert pinned.tiers == ["disk"]  # block 1 only: the run stops at the corrupt block 2
        assert not path.exists()
        assert kv.metric("flotilla_kvstore_corrupt_blocks_total") == 1
        assert (await lookup(bus, kv, third.namespace, [1, 2, 3])).tiers == ["host"]

        # SIGTERM: a clean exit removes the arena file
        kv.process.send_signal(signal.SIGTERM)
        assert kv.process.wait(timeout=15) == 0
        assert not Path(third.arena_path).exists()
    finally:
        await bus.close()


async def test_a_silent_owner_loses_its_pins_and_reservations(kvstore_factory):
    kv = kvstore_factory(disk=False)
    bus = await Bus.connect(kv.nats_url, name="test")
    try:
        await wait_ready(bus, kv)
        reply = await attach(bus, kv, "worker")
        arena = KvArena.attach(reply.arena_path)
        await store_blocks(bus, kv, reply, arena, [1, 2])
        arena.close()
        started = time.monotonic()  # before the kvstore first hears of the silent owner
        await pin(bus, kv, reply.namespace, "silent", [1], owner="silent-scheduler")
        await pin(bus, kv, reply.namespace, "alive", [2], owner="live-scheduler")
        reserved = await bus.request(kv.subject("reserve"), KvReserveRequest(
            namespace=reply.namespace, owner_id="silent-worker", num_slots=5), KvReserveReply)
        assert len(reserved.slot_ids) == 5

        async def pinned_count():
            await bus.publish(kv.subject("keepalive"), KvKeepAlive(owner_id="live-scheduler"))
            stats = await bus.request(kv.subject("stats"), Empty(), KvStatsReply)
            return tier(stats, "host").num_pinned
        assert await pinned_count() == 2

        # The silent owners are heard from last at different times (the worker at its
        # commit, the scheduler at its pin, the silent worker at its reserve) and expired
        # by a sweep every second: one sweep may drop the pin and leave the 5 reserved
        # slots for the next. Wait for all three, the live owner kept alive meanwhile.
        async def silent_owners_expired() -> bool:
            num_pinned = await pinned_count()
            assert num_pinned >= 1, "the live owner's pin went too"
            return num_pinned == 1 and kv.metric("flotilla_kvstore_expired_owners_total") >= 3
        await until(silent_owners_expired, 10 + OWNER_TIMEOUT_S, "the silent owners to expire")
        assert time.monotonic() - started >= OWNER_TIMEOUT_S  # never before its timeout
        # its 5 reserved slots are free again: 62 more can be reserved (cap: half of 64)
        more = await bus.request(kv.subject("reserve"), KvReserveRequest(
            namespace=reply.namespace, owner_id="live-scheduler", num_slots=64), KvReserveReply)
        assert len(more.slot_ids) == 32
        assert kv.metric("flotilla_kvstore_expired_owners_total") == 3  # not the live one
    finally:
        await bus.close()


async def _is(awaitable, expected) -> bool:
    return await awaitable == expected


async def test_commit_published_without_waiting_and_bad_layouts_refused(kvstore_factory):
    kv = kvstore_factory(disk=False)
    bus = await Bus.connect(kv.nats_url, name="test")
    try:
        await wait_ready(bus, kv)
        reply = await attach(bus, kv, "worker")
        reserved = await bus.request(kv.subject("reserve"), KvReserveRequest(
            namespace=reply.namespace, owner_id="worker", num_slots=1), KvReserveReply)
        await bus.publish(kv.subject("commit"), KvCommitRequest(
            namespace=reply.namespace, owner_id="worker", store_id=reply.store_id,
            block_hashes=[h(7)], slot_ids=reserved.slot_ids[:1], token_ids=[7], block_size=1))
        await until(lambda: _is(_tiers(bus, kv, reply.namespace), ["host"]), 5, "the commit")
        bad = KvLayout(weights_version="x", dtype="float32", num_layers=0, block_size=4,
                       num_kv_heads=1, head_dim=1)
        with pytest.raises(FlotillaError) as error:
            await bus.request(kv.subject("attach"), KvAttachRequest(
                owner_id="w", layout=bad, itemsize=4), KvAttachReply)
        assert error.value.status == 400
        with pytest.raises(FlotillaError):  # same namespace, another slot size
            await bus.request(kv.subject("attach"), KvAttachRequest(
                owner_id="w", layout=LAYOUT, itemsize=2), KvAttachReply)
    finally:
        await bus.close()


async def _tiers(bus: Bus, kv: KvStoreProcess, namespace: str) -> list[str]:
    return (await lookup(bus, kv, namespace, [7])).tiers


async def test_with_the_console_exporter_each_request_is_a_span_in_the_callers_trace(
        tmp_path, nats_url):
    """``--otel-exporter console``: the kvstore's span of a request is the child of the
    caller's span (from the traceparent header), printed when it exits."""
    from opentelemetry.sdk.trace import TracerProvider

    kv = KvStoreProcess(tmp_path, nats_url, disk=False)
    kv.args += ["--otel-exporter", "console"]
    kv.start()
    bus = await Bus.connect(kv.nats_url, name="test")
    try:
        await wait_ready(bus, kv)
        with TracerProvider().get_tracer("test").start_as_current_span("caller") as caller:
            await bus.request(kv.subject("stats"), Empty(), KvStatsReply)
        kv.process.send_signal(signal.SIGTERM)  # a clean exit exports the spans left
        assert kv.process.wait(timeout=30) == 0
    finally:
        await bus.close()
        kv.stop()
    context = caller.get_span_context()
    spans = printed_spans((tmp_path / "kvstore-1.log").read_text())
    (span,) = [span for span in spans
               if span["context"]["trace_id"] == f"0x{context.trace_id:032x}"]
    assert span["name"] == kv.subject("stats") and span["kind"] == "SpanKind.SERVER"
    assert span["parent_id"] == f"0x{context.span_id:016x}"
    assert any(span["parent_id"] is None for span in spans)  # wait_ready's: no caller span


def printed_spans(text: str) -> list[dict]:
    """The spans ConsoleSpanExporter printed (indented JSON objects) among the log lines."""
    decoder, spans, position = json.JSONDecoder(), [], 0
    while (position := text.find("\n{\n", position)) >= 0:
        span, position = decoder.raw_decode(text, position + 1)
        spans.append(span)
    return spans
