"""The load generator: send requests on a schedule, at most N in flight, and time them."""

from __future__ import annotations

import asyncio
import math
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from cli.bench.client import (
    ClientPool, HttpClient, RequestSettings, is_connection_error, new_record, send,
)
from cli.bench.datasets import BenchRequest
from cli.bench.metrics import RequestRecord, summarize
from cli.bench.pauses import ClientPauses


@dataclass(frozen=True)
class LoadSettings:
    request_rate: float = math.inf  # requests per second; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is a Poisson process
    max_concurrency: int | None = None  # None: no limit
    seed: int = 0


DEADLINE_ERROR = "unfinished at the --max-duration deadline"


@dataclass
class RunResult:
    records: list[RequestRecord]  # the finished requests (completed or failed), dataset order
    duration_s: float  # first send to last reply, or to the deadline
    # a run cut short at its deadline: requests sent but unfinished (what had arrived of
    # them, error DEADLINE_ERROR), and how many were never sent
    in_flight: list[RequestRecord] = field(default_factory=list)
    num_not_sent: int = 0
    deadline_reached: bool = False
    started_unix: float = 0.0  # the first send, wall clock: to match servers' logs
    client: dict = field(default_factory=dict)  # the client's own pauses (pauses.py)

    def summary(self, slo_s: dict[str, float] | None = None) -> dict:
        return summarize(self.records, self.duration_s, slo_s, num_in_flight=len(self.in_flight),
                         num_not_sent=self.num_not_sent, deadline_reached=self.deadline_reached,
                         started_unix=self.started_unix) | self.client


def arrival_gaps(num_requests: int, request_rate: float, burstiness: float = 1.0,
                 seed: int = 0) -> list[float]:
    """Seconds to wait before each request. Gamma-distributed gaps with mean
    1/request_rate (exponential, i.e. Poisson arrivals, when burstiness is 1); the first
    request goes at once."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, scale) for _ in range(num_requests - 1)]


NUM_CLIENTS = 32  # see ClientPool


def http_client(base_url: str, api_key: str | None, timeout_s: float) -> ClientPool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No pool limit: the benchmark, not the client, decides how many requests are in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    tls = ssl.create_default_context()  # one for all: each client making its own took ~35 ms
    return ClientPool([httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                         timeout=httpx.Timeout(timeout_s, connect=30.0),
                                         verify=tls)
                       for _ in range(NUM_CLIENTS)])


async def run_load(client: HttpClient, requests: list[BenchRequest],
                   settings: RequestSettings, load: LoadSettings,
                   on_done: Callable[[RequestRecord], None] = lambda record: None,
                   max_duration_s: float | None = None) -> RunResult:
    """Send every request on the arrival schedule and wait for all of them, or until
    ``max_duration_s`` has passed: then cancel what is in flight and return what finished.
    The result says how long the client itself paused."""
    async with ClientPauses() as pauses:
        result = await _run_load(client, requests, settings, load, on_done, max_duration_s)
    result.client = pauses.figures()
    return result


async def _run_load(client: HttpClient, requests: list[BenchRequest],
                    settings: RequestSettings, load: LoadSettings,
                    on_done: Callable[[RequestRecord], None],
                    max_duration_s: float | None) -> RunResult:
    gaps = arrival_gaps(len(requests), load.request_rate, load.burstiness, load.seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    records = [new_record(request) for request in requests]
    sent = [False] * len(requests)
    finished = [False] * len(requests)
    started, started_unix = time.perf_counter(), time.time()

    async def one(i: int) -> None:
        if limit is None:
            await send_one(i)
        else:
            async with limit:
                await send_one(i)

    async def send_one(i: int) -> None:
        sent[i] = True
        await send(client, requests[i], settings, started, records[i])
        finished[i] = True
        on_done(records[i])

    tasks: list[asyncio.Task] = []

    async def dispatch() -> None:
        # each request at its own time on the schedule: a sleep that woke late (the loop
        # busy reading streams) must not push every later send back (it did: by 4.2 s over
        # 320 requests at 40 req/s on an H200, more behind a server of more chunk events)
        due = started
        for i, gap in enumerate(gaps):
            due += gap
            if due > time.perf_counter():
                await asyncio.sleep(due - time.perf_counter())
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)

    dispatcher = asyncio.create_task(dispatch())
    done, _ = await asyncio.wait({dispatcher}, timeout=max_duration_s)
    duration_s = time.perf_counter() - started
    if done:
        dispatcher.result()  # a bug in a callback surfaces here
        return RunResult(records, duration_s, started_unix=started_unix)
    for task in (dispatcher, *tasks):
        task.cancel()
    await asyncio.gather(dispatcher, *tasks, return_exceptions=True)
    in_flight = [r for r, s, f in zip(records, sent, finished) if s and not f]
    for record in in_flight:
        record.error = DEADLINE_ERROR
    return RunResult([r for r, f in zip(records, finished) if f], duration_s, in_flight,
                     num_not_sent=sent.count(False), deadline_reached=True,
                     started_unix=started_unix)


async def warm_up(client: HttpClient, requests: list[BenchRequest],
                  settings: RequestSettings, num_warmups: int,
                  max_duration_s: float | None = None,
                  warn: Callable[[str], None] = lambda message: None) -> list[RequestRecord]:
    """Send ``num_warmups`` requests one by one (not measured). A failed warm-up is a
    warning (``warn``) and the run goes on, unless every one failed to reach the server
    (an HTTP error status, a refused or broken connection, a stall): then raise, so a wrong
    URL, model name or key stops the run before it starts. Raise too if the warm-up is not
    done within ``max_duration_s``."""
    if num_warmups <= 0 or not requests:
        return []
    records: list[RequestRecord] = []

    async def warm() -> None:
        for i in range(num_warmups):
            request = requests[i % len(requests)]
            records.append(new_record(request))
            await send(client, request, settings, time.perf_counter(), records[-1])

    try:
        await asyncio.wait_for(warm(), max_duration_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"the warm-up did not finish within --max-duration "
                           f"{max_duration_s:g} s (is the server stalled?)") from None
    failed = [record for record in records if not record.success]
    if len(failed) == len(records) and all(is_connection_error(r.error) for r in failed):
        raise RuntimeError(f"warm-up request failed: {records[-1].error}")
    for record in failed:
        warn(f"warning: a warm-up request failed ({record.error}); the run goes on")
    return records
