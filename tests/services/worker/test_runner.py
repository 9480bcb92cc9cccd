"""ModelRunner on the real SmolLM2 weights: batched, chunked, staggered greedy generation must equal
Hugging Face ``generate(do_sample=False)`` token for token; plus plan validation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import resolve_model

NUM_NEW_TOKENS = 26
BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)


@pytest.fixture(scope="module")
def model_files():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def runner(model_files):
    config = WorkerConfig(device="cpu", dtype="auto", kv_cache_memory="24MiB", block_size=BLOCK_SIZE)
    return build_runner(config, model_files)


@pytest.fixture(scope="module")
def prompts(model_files) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_files.path)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    code = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    return [list(chat), tokenizer("The history of the Roman Empire")["input_ids"],
            tokenizer(code)["input_ids"]]


@pytest.fixture(scope="module")
def hf_outputs(model_files, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_files.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NUM_NEW_TOKENS)
                [0, len(p):].tolist() for p in prompts]


class MiniScheduler:
    """Just enough scheduling to drive the runner: arrivals, a token budget (decodes first, then
    prompt chunks), blocks from a free list, requests dropped once they have their tokens."""

    def __init__(self, num_blocks: int, token_budget: int):
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.token_budget = token_budget
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.chunked: set[str] = set()  # requests whose prompt took more than one step
        self.sent: set[str] = set()

    def plan(self, step_id: int, arrived: dict[str, list[int]]) -> StepPlan:
        for request_id, prompt in arrived.items():
            self.tokens[request_id], self.num_computed[request_id] = list(prompt), 0
            self.block_ids[request_id], self.outputs[request_id] = [], []
        new_requests, scheduled, budget = [], [], self.token_budget
        running = [r for r in self.tokens if r not in self.finished]
        decodes = [r for r in running if len(self.tokens[r]) - self.num_computed[r] == 1]
        for request_id in decodes + [r for r in running if r not in decodes]:
            num_new = min(len(self.tokens[request_id]) - self.num_computed[request_id], budget)
            if num_new == 0:
                continue
            num_needed = math.ceil((self.num_computed[request_id] + num_new) / BLOCK_SIZE)
            num_missing = num_needed - len(self.block_ids[request_id])
            new_block_ids = [self.free_blocks.pop() for _ in range(num_missing)]
            self.block_ids[request_id] += new_block_ids
            if request_id not in self.sent:  # first time: everything in full, blocks included
                self.sent.add(request_id)
                new_requests.append(NewRequestData(
                    request_id, list(self.tokens[request_id]), GREEDY,
                    list(self.block_ids[request_id])))
                new_block_ids = []
            if self.num_computed[request_id] + num_new < len(self.tokens[request_id]):
                self.chunked.add(request_id)
            scheduled.append(ScheduledRequest(request_id, num_new, new_block_ids))
            self.num_computed[request_id] += num_new
            budget -= num_new
        finished, self.finished = self.finished, []
        for request_id in finished:
            del self.tokens[request_id]
        return StepPlan(step_id, new_requests, scheduled, finished)

    def update(self, request_ids: list[str], token_ids: list[int]) -> None:
        for request_id, token_id in zip(request_ids, token_ids):
            self.tokens[request_id].append(token_id)
            self.outputs[request_id].append(token_id)
            if len(self.outputs[request_id]) == NUM_NEW_TOKENS:
                self.finished.append(request_id)
                self.free_blocks += self.block_ids.pop(request_id)


def test_batched_chunked_staggered_greedy_equals_hf(runner, prompts, hf_outputs):
    assert all(len(output) == NUM_NEW_TOKENS for output in hf_outputs)  # no early EOS: a full check
    arrival_steps = {"chat": 0, "roman": 2, "code": 5}
    prompt_of = dict(zip(arrival_steps, prompts))
    scheduler = MiniScheduler(runner.num_blocks, token_budget=16)
    num_samples_per_step = []
    for step_id in range(200):
        arrived = {r: prompt_of[r] for r, s in arrival_steps.items() if s == step_id}
        plan = scheduler.plan(step_id, arrived)
        result = runner.execute(plan)
        assert result.step_id == step_id and result.step_time_s > 0
        if not plan.scheduled and step_id > max(arrival_steps.values()):
            break
        scheduler.update(result.request_ids, result.sampled_token_ids)
        num_samples_per_step.append(len(result.request_ids))
    assert scheduler.chunked >= {"chat", "code"}  # prompts over the budget were split
    assert max(num_samples_per_step) == 3  # at some point all three decode together
    assert [scheduler.outputs[r] for r in arrival_steps] == hf_outputs
    assert runner.num_requests == 0  # the last plan told it to forget them all


def test_runner_public_attributes(runner, model_files):
    assert runner.model_name == model_files.name == "SmolLM2-135M-Instruct"
    assert (runner.device, runner.dtype, runner.block_size) == ("cpu", "float32", BLOCK_SIZE)
    assert runner.max_model_len == 8192 and runner.eos_token_ids == [2]
    bytes_per_block = 2 * 30 * BLOCK_SIZE * 3 * 64 * 4
    assert runner.num_blocks == 24 * 2**20 // bytes_per_block
    assert runner.kv_cache_bytes == runner.num_blocks * bytes_per_block


def test_partial_chunk_samples_nothing_and_finished_requests_are_dropped(runner):
    prompt = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 29]
    plan = StepPlan(0, [NewRequestData("partial", prompt, GREEDY, [0])],
                    [ScheduledRequest("partial", 6)])  # 6 of 10 prompt tokens
    result = runner.execute(plan)
    assert result.request_ids == [] and result.sampled_token_ids == []
    result = runner.execute(StepPlan(1, [], [ScheduledRequest("partial", 4, [1])]))
    assert result.request_ids == ["partial"] and len(result.sampled_token_ids) == 1
    num_before = runner.num_requests
    runner.execute(StepPlan(2, [], [], ["partial", "never-seen"]))
    assert runner.num_requests == num_before - 1
    with pytest.raises(ValueError, match="unknown request id"):
        runner.execute(StepPlan(3, [], [ScheduledRequest("partial", 1)]))
    runner.execute(StepPlan(4, [NewRequestData("x", prompt, GREEDY, [0, 1])], []))
    runner.reset()
    assert runner.num_requests == 0


@pytest.mark.parametrize("plan, message", [
    (StepPlan(0, [NewRequestData("a", [1] * 9, GREEDY, [0])], [ScheduledRequest("a", 9)]),
     "too few blocks"),
    (StepPlan(0, [NewRequestData("b", [1] * 3, GREEDY, [0])], [ScheduledRequest("b", 4)]),
     "3 tokens"),
    (StepPlan(0, [NewRequestData("c", [1] * 3, GREEDY, [10**6])], []), "outside"),
    (StepPlan(0, [], [ScheduledRequest("nobody", 1)]), "unknown request id"),
])
def test_bad_plans_raise_clear_errors(runner, plan, message):
    with pytest.raises(ValueError, match=message):
        runner.execute(plan)
    runner.execute(StepPlan(1, [], [], ["a", "b", "c"]))


def test_a_seeded_request_resumed_after_preemption_draws_the_same_tokens(runner):
    """The scheduler resends a preempted request with its outputs so far; its seeded
    draws must continue exactly as if it had never stopped."""
    prompt = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 29]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=8)

    def generate(request_id: str, token_ids: list[int], num_prompt: int, num_new: int) -> list[int]:
        blocks = list(range(4 * len(request_id), 4 * len(request_id) + 4))
        plan = StepPlan(0, [NewRequestData(request_id, token_ids, seeded, blocks, 0, num_prompt)],
                        [ScheduledRequest(request_id, len(token_ids))])
        outputs = runner.execute(plan).sampled_token_ids
        for step in range(1, num_new):
            outputs += runner.execute(StepPlan(step, [], [ScheduledRequest(request_id, 1)]))\
                .sampled_token_ids
        runner.execute(StepPlan(num_new, [], [], [request_id]))
        return outputs

    straight = generate("s", prompt, len(prompt), 6)
    resumed = generate("resumed", prompt + straight[:3], len(prompt), 3)
    assert resumed == straight[3:]
    assert generate("again", prompt, len(prompt), 6) == straight


def test_prompt_and_output_logprobs_match_hugging_face(runner, model_files, prompts):
    """fp32 on CPU: the logprobs of every prompt token (computed over two chunks) and of the
    greedy outputs equal log_softmax of transformers' logits on the same weights."""
    prompt = prompts[1]  # 6 tokens: 4 + 2
    params = SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, max_tokens=4)
    first = 4
    result = runner.execute(StepPlan(0, [NewRequestData("lp", prompt, params, [20, 21])],
                                     [ScheduledRequest("lp", first)]))
    prompt_logprobs = list(result.prompt_logprobs["lp"])
    assert result.request_ids == [] and len(prompt_logprobs) == first
    result = runner.execute(StepPlan(1, [], [ScheduledRequest("lp", len(prompt) - first)]))
    prompt_logprobs += result.prompt_logprobs["lp"]
    outputs, output_logprobs = list(result.sampled_token_ids), list(result.logprobs)
    for step in range(2, 5):
        result = runner.execute(StepPlan(step, [], [ScheduledRequest("lp", 1)]))
        outputs += result.sampled_token_ids
        output_logprobs += result.logprobs
    runner.execute(StepPlan(5, [], [], ["lp"]))

    model = AutoModelForCausalLM.from_pretrained(model_files.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        token_ids = torch.tensor([prompt + outputs[:-1]])
        reference = model(token_ids).logits[0].log_softmax(-1)  # [num_tokens, vocab_size]
    assert [e.token_id for e in prompt_logprobs] == prompt[1:]
    assert [e.token_id for e in output_logprobs] == outputs
    for position, entry in enumerate(prompt_logprobs + output_logprobs):
        expected = reference[position]
        assert abs(entry.logprob - float(expected[entry.token_id])) < 1e-3
        num_top = 2 if position < len(prompt) - 1 else 3
        assert entry.top_token_ids == expected.topk(num_top).indices.tolist()
        assert entry.top_logprobs == pytest.approx(expected.topk(num_top).values.tolist(), abs=1e-3)
    assert all(e.top_token_ids[0] == e.token_id for e in output_logprobs)  # greedy
