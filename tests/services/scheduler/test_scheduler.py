"""The scheduler policy driven step by step, with a fake worker that tracks what a
real one would hold (its own token lists and block tables) and checks every plan."""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.errors import InvalidRequest
from shared.messages import GenerateRequest, SamplingParams, StepPlan, StepResult

EOS = 0


class FakeWorker:
    """Mirrors the worker's bookkeeping; the sampled token is a pure function of the
    request and its position, so a preempted-and-recomputed request must continue
    with exactly the tokens it would have produced."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.state: dict[str, dict] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.state.pop(request_id)
        for new in plan.new_requests:
            assert new.request_id not in self.state
            self.state[new.request_id] = {"tokens": list(new.token_ids), "blocks": list(new.block_ids),
                                          "computed": new.num_computed_tokens}
        used = [b for s in self.state.values() for b in s["blocks"]]
        assert len(used) == len(set(used)), "a block is owned twice"
        request_ids, token_ids = [], []
        for sched in plan.scheduled:
            st = self.state[sched.request_id]
            st["blocks"] += sched.new_block_ids
            end = st["computed"] + sched.num_new_tokens
            assert end <= len(st["tokens"])
            assert len(st["blocks"]) * 4 >= end, "not enough blocks for the computed tokens"
            st["computed"] = end
            if end == len(st["tokens"]):
                token = next_token(sched.request_id, len(st["tokens"]))
                st["tokens"].append(token)
                request_ids.append(sched.request_id)
                token_ids.append(token)
        return StepResult(plan.step_id, request_ids, token_ids)


def next_token(request_id: str, position: int) -> int:
    return 1 + (hash((request_id, position)) % 1000)


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, num_blocks=num_blocks, block_size=4, max_model_len=max_model_len,
                     eos_token_ids=[EOS])


def request(request_id: str, num_prompt: int, max_tokens: int, **sampling) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=list(range(1, num_prompt + 1)),
                           sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                           output_subject="out")


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps=10_000):
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    plans = []
    for _ in range(max_steps):
        plan = scheduler.schedule()
        if plan is None:
            break
        plans.append(plan)
        for emitted in scheduler.update(plan, worker.execute(plan)):
            out = emitted.output
            assert out.request_id not in finish, "output after finish"
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
    assert not scheduler.has_work
    return outputs, finish, plans


def expected_tokens(request_id: str, num_prompt: int, max_tokens: int) -> list[int]:
    return [next_token(request_id, num_prompt + i) for i in range(max_tokens)]


def test_all_requests_complete_with_their_own_tokens():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    for i in range(5):
        scheduler.add_request(request(f"r{i}", 3 + i, 6, ignore_eos=True))
    outputs, finish, _ = run_to_completion(scheduler, worker)
    for i in range(5):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 3 + i, 6)
        assert finish[f"r{i}"] == "length"
    assert scheduler.block_manager.num_free_blocks == 64


def test_max_num_seqs_limits_the_running_batch():
    scheduler, worker = make_scheduler(max_num_seqs=2), FakeWorker(64)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", 4, 3, ignore_eos=True))
    _, finish, plans = run_to_completion(scheduler, worker)
    assert max(len(p.scheduled) for p in plans) == 2
    assert len(finish) == 4


def test_long_prompt_is_chunked_under_the_token_budget_while_others_decode():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker(64)
    scheduler.add_request(request("short", 2, 10, ignore_eos=True))
    scheduler.add_request(request("long", 30, 2, ignore_eos=True))
    outputs, _, plans = run_to_completion(scheduler, worker)
    assert all(sum(s.num_new_tokens for s in p.scheduled) <= 8 for p in plans)
    chunks = [s.num_new_tokens for p in plans for s in p.scheduled if s.request_id == "long"]
    assert chunks[:4] == [6, 7, 7, 7]  # short decodes one token in each of those steps
    assert outputs["long"] == expected_tokens("long", 30, 2)
    assert outputs["short"] == expected_tokens("short", 2, 10)


def test_waiting_requests_are_admitted_in_arrival_order_when_blocks_free_up():
    scheduler, worker = make_scheduler(num_blocks=5), FakeWorker(5)
    scheduler.add_request(request("a", 12, 4, ignore_eos=True))  # 3 blocks for its prompt
    scheduler.add_request(request("b", 12, 4, ignore_eos=True))  # 3 more: does not fit yet
    scheduler.add_request(request("c", 2, 2, ignore_eos=True))  # would fit, but b is first
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["a"]
    scheduler.update(first, worker.execute(first))
    outputs, finish, plans = run_to_completion(scheduler, worker)
    admitted = [n.request_id for p in plans for n in p.new_requests]
    assert admitted.index("b") < admitted.index("c")
    assert set(finish) == {"a", "b", "c"}
    assert outputs["b"] == expected_tokens("b", 12, 4)


def test_eos_and_stop_token_ids_end_a_request_and_free_its_blocks():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    stop_token = next_token("s", 5)
    scheduler.add_request(request("s", 5, 50, stop_token_ids=[stop_token]))
    outputs, finish, _ = run_to_completion(scheduler, worker)
    assert outputs["s"] == [stop_token] and finish["s"] == "stop"
    assert scheduler.block_manager.num_used_blocks == 0


def test_preemption_recomputes_and_every_request_gets_its_exact_tokens():
    # 12 blocks of 4 tokens; 6 requests each growing to 24 tokens (6 blocks): only two fit.
    scheduler, worker = make_scheduler(num_blocks=12, max_num_batched_tokens=32), FakeWorker(12)
    for i in range(6):
        scheduler.add_request(request(f"r{i}", 4, 20, ignore_eos=True))
    outputs, finish, plans = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions > 0
    resumed = [n for p in plans for n in p.new_requests if n.token_ids[4:]]
    assert resumed, "a preempted request is resent with its outputs so far"
    for i in range(6):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 4, 20)
    assert scheduler.block_manager.num_free_blocks == 12


def test_abort_frees_blocks_and_tells_the_worker():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    scheduler.add_request(request("x", 8, 100, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    scheduler.abort(["x"])
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_work
    scheduler.add_request(request("y", 2, 1, ignore_eos=True))
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ["x"]


@pytest.mark.parametrize("num_prompt,max_tokens,match", [
    (0, 4, "empty"), (500, 100, "context length"), (200, 100, "KV cache"),
])
def test_requests_that_can_never_run_are_rejected(num_prompt, max_tokens, match):
    scheduler = make_scheduler(num_blocks=64)  # 256 tokens of cache, 512 context
    with pytest.raises(InvalidRequest, match=match):
        scheduler.add_request(request("bad", num_prompt, max_tokens))
