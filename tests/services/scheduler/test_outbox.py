"""The outbox's bookkeeping, driven with explicit times: what waits for the link, as
which error, and when it is sent again (the service's sends: test_drain.py)."""

from __future__ import annotations

from services.scheduler.outbox import REDELIVERY_AFTER_S, Outbox, bus_lost_error
from services.scheduler.scheduler import Emitted
from shared.messages import RequestOutput

RECENT_S = 3.0


def final(request_id: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=[7], finish_reason="length",
                         num_prompt_tokens=4)


def ids(due: dict) -> dict[str, list[str]]:
    return {subject: [h.emitted.output.request_id for h in items] for subject, items in due.items()}


def test_held_outputs_become_errors_and_wait_for_the_link_to_settle():
    outbox = Outbox(RECENT_S)
    outbox.hold([Emitted("out.a", final("r1")), Emitted("out.b", final("r2"))],
                bus_lost_error(), now=10.0)
    assert outbox.num_held == 2
    connected_at = 11.0
    assert outbox.due(11.2, connected_at) == {}  # the gateways may not have subscribed yet
    due = outbox.due(connected_at + REDELIVERY_AFTER_S[0], connected_at)
    assert ids(due) == {"out.a": ["r1"], "out.b": ["r2"]}
    output = due["out.a"][0].emitted.output
    assert output.finish_reason == "error" and output.new_token_ids == []
    assert output.error.code == "nats_unavailable" and output.num_prompt_tokens == 4


def test_each_output_is_sent_once_per_redelivery_time_then_forgotten():
    outbox = Outbox(RECENT_S)
    outbox.hold([Emitted("out", final("r"))], bus_lost_error(), now=0.0)
    for after_s in REDELIVERY_AFTER_S:
        due = outbox.due(after_s, connected_at=0.0)
        assert ids(due) == {"out": ["r"]}
        outbox.sent(due["out"])
        outbox.settle()
        assert outbox.due(after_s, connected_at=0.0) == {}  # not again until the next time
    assert outbox.num_held == 0


def test_a_final_send_takes_everything_once():
    outbox = Outbox(RECENT_S)
    outbox.hold([Emitted("out", final("r"))], bus_lost_error(), now=0.0)
    assert ids(outbox.due(0.0, connected_at=0.0, final=True)) == {"out": ["r"]}
    outbox.settle(final=True)
    assert outbox.num_held == 0


def test_a_lost_link_holds_only_the_final_outputs_sent_just_before():
    outbox = Outbox(RECENT_S)
    outbox.published("out", [final("old")], now=0.0)
    running = RequestOutput(request_id="running", new_token_ids=[1])
    outbox.published("out", [final("recent"), running], now=5.0)
    outbox.link_lost(now=6.0)
    assert ids(outbox.due(0.0, connected_at=0.0, final=True)) == {"out": ["recent"]}
    outbox.link_lost(now=6.5)  # a second drop holds nothing more
    assert outbox.num_held == 1
