"""The scheduler's outputs on the bus: each step's RequestOutputs published to the gateways
waiting for them; with the link down, the final ones held as errors in the outbox
(outbox.py, pure) and sent again once it returns. Part of the scheduler's bus edge with
service.py (kept apart so that file stays about the step loop)."""

from __future__ import annotations

import asyncio
import time

import structlog

from services.scheduler.outbox import REDELIVERY_TICK_S, Outbox, bus_lost_error, by_subject
from services.scheduler.request_spans import NoRequestSpans, RequestSpans
from services.scheduler.scheduler import Emitted
from shared.bus import Bus
from shared.errors import ServiceUnavailable
from shared.messages import OutputBatch

log = structlog.get_logger()


class OutputPublisher:
    def __init__(self, bus: Bus, outbox: Outbox,
                 spans: NoRequestSpans | RequestSpans | None = None) -> None:
        self.bus = bus
        self.outbox = outbox
        self.spans = spans or NoRequestSpans()  # each output seen by its request's span

    async def publish(self, emitted: list[Emitted]) -> None:
        """Send outputs to their gateways. Never raises: with the link down, the final
        outputs are held as errors (earlier outputs of those requests may be lost too:
        the gateway resumes them from what it has) and the running requests fail at the
        step loop's next turn."""
        self.spans.outputs(emitted)
        now, published_at = time.monotonic(), time.time()
        for subject, outputs in by_subject(emitted).items():
            try:
                await self.bus.publish(subject, OutputBatch(outputs, published_at))
            except ServiceUnavailable:
                self.outbox.hold([Emitted(subject, o) for o in outputs
                                  if o.finish_reason is not None], bus_lost_error(), now)
                continue
            self.outbox.published(subject, outputs, now)

    async def redeliver(self) -> None:
        """Send the held outputs as they fall due, until cancelled."""
        while True:
            await asyncio.sleep(REDELIVERY_TICK_S)
            await self.send_held()

    async def send_held(self, *, final: bool = False) -> None:
        """Send the held error outputs that are due (``final``: all of them, once)."""
        if not self.outbox.num_held or not self.bus.is_connected:
            return
        due = self.outbox.due(time.monotonic(), self.bus.connected_at, final=final)
        try:
            for subject, items in due.items():
                await self.bus.publish(subject, OutputBatch([h.emitted.output for h in items]))
                self.outbox.sent(items)
        except ServiceUnavailable:
            pass  # down again: the rest wait for the next reconnect
        finally:
            self.outbox.settle(final=final)
        if due:
            log.info("error_outputs_sent", num_outputs=sum(map(len, due.values())), final=final)
