"""The gateway's view of the other tiers' health (/health): one NATS health call to each
service kind, answered by any of its replicas, within a deadline."""

from __future__ import annotations

import asyncio

from shared.bus import Bus
from shared.errors import FlotillaError
from shared.messages import Empty, HealthReply
from shared.subjects import Subjects

SERVICES = ("tokenizer", "scheduler", "worker")


async def services_health(bus: Bus, subjects: Subjects, timeout_s: float) -> dict[str, dict]:
    """Each service's status, instance and details, or "unavailable" with the error."""

    async def check(service: str) -> dict:
        try:
            reply = await bus.request(subjects.health(service), Empty(), HealthReply,
                                      timeout=timeout_s)
            return {"status": reply.status, "instance_id": reply.instance_id, **reply.detail}
        except FlotillaError as exc:
            return {"status": "unavailable", "error": exc.message}

    results = await asyncio.gather(*(check(service) for service in SERVICES))
    return dict(zip(SERVICES, results))
