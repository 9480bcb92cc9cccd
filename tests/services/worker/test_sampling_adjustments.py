"""Sampler: logit_bias, min_tokens, penalties, min_p and logprobs, each against a plain
per-row reference, mixed in one batch, and independent of the batch around a seeded row."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.sampler import Sampler, make_generator
from shared.messages import SamplingParams

VOCAB_SIZE = 64
EOS_ID = 2


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


def make_sampler(device: str = "cpu") -> Sampler:
    return Sampler(VOCAB_SIZE, [EOS_ID], torch.device(device))


def run(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
        request_ids: list[str] | None = None, output_indices: list[int] | None = None):
    request_ids = request_ids or [f"r{i}" for i in range(len(params))]
    return sampler.sample(logits.clone(), request_ids, params, output_indices or [0] * len(params),
                          [make_generator(p, "cpu") for p in params])


def penalized_ref(logits: torch.Tensor, prompt: list[int], outputs: list[int],
                  p: SamplingParams) -> torch.Tensor:
    """One row, token by token, as the OpenAI / HF definitions read."""
    logits = logits.clone()
    for token in set(prompt) | set(outputs):
        value = logits[token]
        logits[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token in set(outputs):
        logits[token] -= p.frequency_penalty * outputs.count(token) + p.presence_penalty
    return logits


def test_penalties_match_the_reference_per_row():
    sampler = make_sampler()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=1.5,
                             presence_penalty=1.0)]
    histories = [([5, 6, 7], [8, 8, 9]), ([1, 2], [3, 3, 3, 4]), ([9], [10]), ([11, 12], [11, 13])]
    for i, (p, (prompt, outputs)) in enumerate(zip(params, histories)):
        sampler.add(f"r{i}", p, prompt + outputs, len(prompt))
    logits = random_logits(4)
    adjusted = sampler.adjusted(logits.clone(), ["r0", "r1", "r2", "r3"], params, [3, 4, 1, 2])
    for i, (p, (prompt, outputs)) in enumerate(zip(params, histories)):
        expected = penalized_ref(logits[i], prompt, outputs, p) if p.has_penalties else logits[i]
        torch.testing.assert_close(adjusted[i], expected)


def test_sampled_tokens_are_counted_for_the_next_step():
    sampler = make_sampler()
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    sampler.add("r", p, [1], 1)
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, 30] = 5.0
    logits[0, 31] = 4.0
    tokens = [run(sampler, logits, [p], ["r"], [i])[0][0] for i in range(4)]
    # each use of a token costs it 2.0: 30 (5 > 4), 31 (4 > 3), 30 (3 > 2), 31 (2 > 1)
    assert tokens == [30, 31, 30, 31]


def test_logit_bias_forces_and_forbids():
    sampler = make_sampler()
    logits = random_logits(2)
    favourite = int(logits[0].argmin())
    banned = int(logits[1].argmax())
    params = [SamplingParams(temperature=0.0, logit_bias={favourite: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={banned: -100.0})]
    tokens, _ = run(sampler, logits, params)
    assert tokens[0] == favourite
    assert tokens[1] != banned and tokens[1] == int(logits[1].topk(2).indices[1])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    sampler = make_sampler()
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, EOS_ID] = 10.0
    logits[0, 7] = 9.0
    logits[0, 8] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert run(sampler, logits, [p], output_indices=[0])[0] == [8]
    assert run(sampler, logits, [p], output_indices=[1])[0] == [8]
    assert run(sampler, logits, [p], output_indices=[2])[0] == [EOS_ID]


def test_min_p_restricts_the_support():
    sampler = make_sampler()
    logits = random_logits(1, seed=3)
    probs = logits[0].softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    params = [SamplingParams(temperature=1.0, min_p=0.2, seed=s) for s in range(300)]
    tokens, _ = run(sampler, logits.expand(300, VOCAB_SIZE).contiguous(), params)
    assert set(tokens) <= allowed and len(set(tokens)) > 1


def test_logprobs_are_the_raw_model_distribution():
    sampler = make_sampler()
    logits = random_logits(3)
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=1, logprobs=0, logit_bias={4: 50.0})]
    sampler.add("r0", params[0], [1, 2, 3], 3)
    tokens, logprobs = run(sampler, logits, params)
    assert logprobs[1] is None
    reference = logits.log_softmax(-1)
    first = logprobs[0]
    assert first.token_id == tokens[0]
    assert math.isclose(first.logprob, float(reference[0, tokens[0]]), abs_tol=1e-6)
    assert first.top_token_ids == reference[0].topk(5).indices.tolist()
    assert first.top_logprobs == pytest.approx(reference[0].topk(5).values.tolist(), abs=1e-6)
    third = logprobs[2]
    assert tokens[2] == 4 and third.top_token_ids == [] and third.top_logprobs == []
    assert math.isclose(third.logprob, float(reference[2, 4]), abs_tol=1e-6)  # before the bias


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_seeded_row_with_every_adjustment_is_the_same_alone_and_in_a_batch(device):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, seed=99,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                            logit_bias={3: 1.5}, min_tokens=3, logprobs=2)
    others = [SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=1.2, frequency_penalty=1.0, seed=5),
              SamplingParams(temperature=0.7)]

    def generate(batch: bool) -> list[int]:
        sampler = make_sampler(device)
        params = [others[0], seeded, others[1], others[2]] if batch else [seeded]
        ids = [f"r{i}" for i in range(len(params))]
        for request_id, p in zip(ids, params):
            sampler.add(request_id, p, [4, 5, 6], 3)
        row = 1 if batch else 0
        tokens = []
        for step in range(12):
            logits = random_logits(len(params), seed=1000 + step)
            logits[row] = random_logits(1, seed=step)[0]
            sampled, _ = sampler.sample(logits.to(device), ids, params, [step] * len(params),
                                        [make_generator(p, device) for p in params])
            tokens.append(sampled[row])
        return tokens

    alone = generate(batch=False)
    assert generate(batch=True) == alone
    assert len(set(alone)) > 1


def test_out_of_range_logit_bias_is_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        make_sampler().add("r", SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), [1], 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_token_bitmask_leaves_only_its_tokens(device):
    from services.worker.structured import apply_token_bitmask, bitmask_width

    vocab_size = 100  # not a multiple of 32: the last word is partial
    allowed = [[0, 31, 32, 99], [], [5]]  # row 1: every token (all bits set)
    bitmask = torch.zeros(3, bitmask_width(vocab_size), dtype=torch.int32)
    bitmask[1] = -1
    for row, tokens in enumerate(allowed):
        for token in tokens:
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF | (1 << token % 32)
            bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word
    logits = torch.randn(3, vocab_size, device=device)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask)
    for row, tokens in enumerate(allowed):
        finite = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert finite == (tokens or list(range(vocab_size)))
        torch.testing.assert_close(masked[row, finite], logits[row, finite])
