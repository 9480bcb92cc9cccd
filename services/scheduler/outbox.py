"""The scheduler's outbox for a NATS outage: which error outputs to send again, and when.
Pure bookkeeping; service.py publishes.

Core NATS keeps nothing, so an output sent around an outage may be gone. When the
scheduler's link drops, every request it holds fails with a 503 (the gateway moves it to
a replica, resuming after the tokens it did get). Those error outputs, plus an error for
each request finished just before the drop (its last output may have died with the
link; a gateway that had it ignores the error), wait here, and are sent again a few
times after the link returns, when the gateways have subscribed again.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from services.scheduler.scheduler import Emitted
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import RequestOutput

# Held outputs are sent this long after the link is back (and after they were held):
# peers resubscribe within about nats-py's reconnect wait (0.5 s) of NATS.
REDELIVERY_AFTER_S = (0.5, 2.0, 5.0)
REDELIVERY_TICK_S = 0.25


def bus_lost_error() -> ServiceUnavailable:
    return ServiceUnavailable("the scheduler lost its connection to NATS while the request ran "
                              "(its output may be incomplete)", code="nats_unavailable")


def by_subject(emitted: list[Emitted]) -> dict[str, list[RequestOutput]]:
    """Outputs grouped by the gateway subject they go to, in order."""
    grouped: dict[str, list[RequestOutput]] = defaultdict(list)
    for item in emitted:
        grouped[item.output_subject].append(item.output)
    return grouped


@dataclass
class HeldOutput:
    """An error output waiting for the link (and the gateways) to come back."""

    emitted: Emitted
    added_at: float
    num_sent: int = 0


class Outbox:
    def __init__(self, recent_final_s: float) -> None:
        # a final output this recent may have been written into a link found dead later
        self.recent_final_s = recent_final_s
        self._held: list[HeldOutput] = []
        self._recent_finals: deque[tuple[float, Emitted]] = deque()

    @property
    def num_held(self) -> int:
        return len(self._held)

    def published(self, subject: str, outputs: list[RequestOutput], now: float) -> None:
        """Outputs went out: keep the final ones a while, in case the link was dead."""
        self._recent_finals.extend((now, Emitted(subject, o)) for o in outputs
                                   if o.finish_reason is not None)
        cutoff = now - self.recent_final_s
        while self._recent_finals and self._recent_finals[0][0] < cutoff:
            self._recent_finals.popleft()

    def hold(self, emitted: list[Emitted], error: FlotillaError, now: float) -> None:
        """Keep these as error outputs, to send once the link is back."""
        info = error.to_info()
        for item in emitted:
            output = item.output
            if output.error is None:
                output = RequestOutput.failure(output.request_id, output.num_prompt_tokens, info)
            self._held.append(HeldOutput(Emitted(item.output_subject, output), now))

    def link_lost(self, now: float) -> None:
        """The link dropped: the final outputs sent just before may be lost with it."""
        cutoff = now - self.recent_final_s
        self.hold([emitted for at, emitted in self._recent_finals if at >= cutoff],
                  bus_lost_error(), now)
        self._recent_finals.clear()

    def due(self, now: float, connected_at: float, *, final: bool = False
            ) -> dict[str, list[HeldOutput]]:
        """The held outputs to send now, by subject (``final``: all of them)."""
        grouped: dict[str, list[HeldOutput]] = defaultdict(list)
        for held in self._held:
            if final or now - max(held.added_at, connected_at) >= \
                    REDELIVERY_AFTER_S[held.num_sent]:
                grouped[held.emitted.output_subject].append(held)
        return grouped

    @staticmethod
    def sent(items: list[HeldOutput]) -> None:
        for held in items:
            held.num_sent += 1

    def settle(self, *, final: bool = False) -> None:
        """After a round of sends: forget what was sent often enough (``final``: all)."""
        self._held = [held for held in self._held
                      if not final and held.num_sent < len(REDELIVERY_AFTER_S)]
