"""Container health probe: ``python -m shared.healthcheck [SERVICE] [--live]``.

Asks the service itself whether it is up and exits 0 (healthy) or 1 (not); 2 means the
probe was called wrongly. Docker's HEALTHCHECK, docker-compose and the Helm chart's
probes all run it, inside the service's container, so it reads the same flags and
``FLOTILLA_*`` variables as the service (NATS URL, subject namespace, replica id, port).
SERVICE defaults to the one running as PID 1 (``python -m services.<name>``).

What each check asks:

- gateway: ``GET /health/ready`` on its port (200: every tier answers and a replica is
  ready: its worker attached and stepping); ``--live``: ``GET /health/live`` (the HTTP
  server is serving, whatever the other tiers do).
- worker: ``{ns}.v1.worker.{replica}.ping``, answered by this replica's worker even
  while a step runs, once its model is loaded.
- scheduler: waits for this replica's stats heartbeat (``{ns}.v1.evt.scheduler.stats``,
  every 0.5 s); ready once it reports its worker attached; ``--live``: any heartbeat.
- kvstore: ``{ns}.v1.kvstore.{node}.health``, answered by this node's kvstore
  (``--node-id`` / ``FLOTILLA_NODE_ID``, as the kvstore itself reads it).
- tokenizer: ``{ns}.v1.tokenizer.health``. The tokenizer has no per-instance subject,
  so any replica may answer: this checks the tier, not necessarily this container.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import msgspec

from shared.config import Section, compose, knob, load_config
from shared.messages import Empty, HealthReply, decode, encode
from shared.scheduler_stats import SchedulerStats
from shared.sections.gateway import Listen
from shared.sections.kvstore import KvNode
from shared.sections.runtime import COMMON, Replica
from shared.subjects import Subjects

SERVICES = ("gateway", "tokenizer", "scheduler", "worker", "kvstore")
ERROR_HEADER = "Flotilla-Error"  # shared.bus.ERROR_HEADER (not imported: keep the probe light)


class Probe(Section, frozen=True, kw_only=True):
    live: Annotated[bool, knob(
        "check liveness only (the process serves), not readiness")] = False
    timeout_s: Annotated[float, knob("give up after this many seconds")] = 3.0


# The probe reads the variables its service reads (the same sections), so it checks the
# replica, node or port the service itself took.
HealthcheckConfig = compose(
    "HealthcheckConfig",
    "flotilla health probe: exits 0 when the service answers, 1 when it does not.",
    (*COMMON, Replica, KvNode, Listen, Probe), module=__name__)


class Unhealthy(Exception):
    """The service did not answer as a healthy one does."""


def main(argv: Sequence[str] | None = None, proc_root: Path = Path("/proc")) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        service = args.pop(0)
    else:
        service = service_from_pid1(proc_root)
    if service not in SERVICES:
        print(f"healthcheck: unknown service {service!r}: give one of {', '.join(SERVICES)}",
              file=sys.stderr)
        return 2
    config = load_config(HealthcheckConfig, args)
    started = time.monotonic()
    try:
        detail = check(service, config)
    except Unhealthy as exc:
        print(f"unhealthy: {service}: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {service}: {detail} ({(time.monotonic() - started) * 1000:.0f} ms)")
    return 0


def service_from_pid1(proc_root: Path = Path("/proc")) -> str | None:
    """'worker' when PID 1 is ``python -m services.worker ...`` (a container's main process)."""
    try:
        words = (proc_root / "1" / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for flag, module in zip(words, words[1:]):
        if flag == b"-m" and module.startswith(b"services."):
            return module.decode().removeprefix("services.").split(".")[0]
    return None


def check(service: str, config: HealthcheckConfig) -> str:
    if service == "gateway":
        return check_gateway(config)
    return asyncio.run(_check_over_nats(service, config))


def check_gateway(config: HealthcheckConfig) -> str:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "", "::") else config.host
    path = "/health/live" if config.live else "/health/ready"
    url = f"http://{host}:{config.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=config.timeout_s) as response:
            return f"GET {path} answered {response.status}"
    except urllib.error.HTTPError as exc:
        raise Unhealthy(f"GET {url} answered {exc.code}: {exc.read(300).decode(errors='replace')}")
    except (urllib.error.URLError, OSError) as exc:
        raise Unhealthy(f"GET {url} failed: {exc}")


async def _check_over_nats(service: str, config: HealthcheckConfig) -> str:
    import nats
    import nats.errors

    async def quiet(_: Exception) -> None:  # the failure is reported once, below
        pass

    try:
        nc = await asyncio.wait_for(nats.connect(
            config.nats_url, name=f"healthcheck-{service}", connect_timeout=config.timeout_s,
            allow_reconnect=False, max_reconnect_attempts=0, error_cb=quiet), config.timeout_s)
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
        raise Unhealthy(f"cannot reach NATS at {config.nats_url}: {exc!r}")
    try:
        subjects = Subjects(config.namespace)
        if service == "scheduler":
            return await _check_scheduler(nc, subjects, config)
        if service == "worker":
            subject = subjects.worker_ping(config.replica_id)
        elif service == "kvstore":
            subject = subjects.kvstore(config.node_id, "health")
        else:
            subject = subjects.health(service)
        return await _request_health(nc, subject, config.timeout_s)
    finally:
        await nc.close()


async def _request_health(nc, subject: str, timeout_s: float) -> str:
    import nats.errors

    try:
        msg = await nc.request(subject, encode(Empty()), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise Unhealthy(f"nothing answers on {subject}")
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        raise Unhealthy(f"no reply on {subject} within {timeout_s:g}s")
    if msg.headers and ERROR_HEADER in msg.headers:
        raise Unhealthy(f"{subject} answered an error: {msg.headers[ERROR_HEADER]}")
    try:
        reply = decode(msg.data, HealthReply)
    except msgspec.DecodeError as exc:
        raise Unhealthy(f"{subject} answered something other than a HealthReply: {exc}")
    if reply.status != "ok":
        raise Unhealthy(f"{subject}: instance {reply.instance_id} says {reply.status!r}")
    return f"{subject}: instance {reply.instance_id} ok"


async def _check_scheduler(nc, subjects: Subjects, config: HealthcheckConfig) -> str:
    """Wait for this replica's heartbeat; for readiness, one saying its worker is attached."""
    heard: asyncio.Queue[SchedulerStats] = asyncio.Queue()

    async def on_stats(msg) -> None:
        try:
            stats = decode(msg.data, SchedulerStats)
        except msgspec.DecodeError:
            return
        if stats.replica_id == config.replica_id:
            heard.put_nowait(stats)

    await nc.subscribe(subjects.scheduler_stats, cb=on_stats)
    deadline = time.monotonic() + config.timeout_s
    last: SchedulerStats | None = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            last = await asyncio.wait_for(heard.get(), left)
        except asyncio.TimeoutError:
            break
        if config.live or last.worker_ready:
            state = "worker attached" if last.worker_ready else "waiting for its worker"
            return f"scheduler {last.scheduler_id} of replica {config.replica_id}: {state}"
    if last is None:
        raise Unhealthy(f"no heartbeat from the scheduler of replica {config.replica_id} "
                        f"on {subjects.scheduler_stats} within {config.timeout_s:g}s")
    raise Unhealthy(f"scheduler {last.scheduler_id} of replica {config.replica_id} "
                    f"has no worker attached")


if __name__ == "__main__":
    sys.exit(main())
