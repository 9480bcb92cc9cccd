"""The load generator: send requests on a schedule, at most N in flight, and time them."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from cli.bench.client import RequestSettings, send
from cli.bench.datasets import BenchRequest
from cli.bench.metrics import RequestRecord


@dataclass(frozen=True)
class LoadSettings:
    request_rate: float = math.inf  # requests per second; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is a Poisson process
    max_concurrency: int | None = None  # None: no limit
    seed: int = 0


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first send to last reply


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


def http_client(base_url: str, api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No pool limit: the benchmark, not the client, decides how many requests are in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                             timeout=httpx.Timeout(timeout_s, connect=30.0))


async def run_load(client: httpx.AsyncClient, requests: list[BenchRequest],
                   settings: RequestSettings, load: LoadSettings,
                   on_done: Callable[[RequestRecord], None] = lambda record: None) -> RunResult:
    gaps = arrival_gaps(len(requests), load.request_rate, load.burstiness, load.seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    started = time.perf_counter()

    async def one(request: BenchRequest) -> RequestRecord:
        if limit is None:
            record = await send(client, request, settings, started)
        else:
            async with limit:
                record = await send(client, request, settings, started)
        on_done(record)
        return record

    tasks = []
    for request, gap in zip(requests, gaps):
        if gap > 0:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(request)))
    records = await asyncio.gather(*tasks)
    return RunResult(list(records), time.perf_counter() - started)


async def warm_up(client: httpx.AsyncClient, requests: list[BenchRequest],
                  settings: RequestSettings, num_warmups: int) -> None:
    """Send ``num_warmups`` requests one by one (not measured). Raise if none succeeds, so
    a wrong URL or model name stops the run before it starts."""
    if num_warmups <= 0 or not requests:
        return
    records = [await send(client, requests[i % len(requests)], settings, time.perf_counter())
               for i in range(num_warmups)]
    if not any(record.success for record in records):
        raise RuntimeError(f"warm-up request failed: {records[-1].error}")
