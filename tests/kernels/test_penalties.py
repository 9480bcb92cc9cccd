"""apply_penalties (Triton; on CPU under the interpreter) against apply_penalties_ref, and the
reference against the definitions token by token."""

from __future__ import annotations

import pytest
import torch

from kernels.penalties import apply_penalties, apply_penalties_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB_SIZE = 1500  # not a multiple of the block


def tables(num_slots: int, gen: torch.Generator):
    counts = torch.randint(0, 3, (num_slots, VOCAB_SIZE), generator=gen, dtype=torch.int32)
    counts *= torch.rand(num_slots, VOCAB_SIZE, generator=gen) < 0.05  # few tokens seen
    prompt = torch.rand(num_slots, VOCAB_SIZE, generator=gen) < 0.05
    return counts, prompt


def params(slots: list[int]) -> torch.Tensor:
    num_rows = len(slots)
    return torch.tensor([slots, [1.3, 0.7, 1.0, 2.0][:num_rows], [0.5, -1.0, 0.0, 2.0][:num_rows],
                         [0.25, 0.5, -2.0, 0.0][:num_rows]], dtype=torch.float32)


def test_ref_follows_the_definitions():
    gen = torch.Generator().manual_seed(0)
    counts, prompt = tables(3, gen)
    logits = torch.randn(4, VOCAB_SIZE, generator=gen) * 3
    packed = params([2, -1, 0, 1])
    out = logits.clone()
    apply_penalties_ref(out, counts, prompt, packed)
    assert torch.equal(out[1], logits[1])  # no slot: untouched
    for row, slot in ((0, 2), (2, 0), (3, 1)):
        repetition, frequency, presence = packed[1:, row].tolist()
        for token in range(VOCAB_SIZE):
            value, count = float(logits[row, token]), int(counts[slot, token])
            if count or prompt[slot, token]:
                value = value / repetition if value > 0 else value * repetition
            value -= frequency * count + presence * (count > 0)
            assert abs(float(out[row, token]) - value) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_ref(dtype):
    gen = torch.Generator().manual_seed(1)
    counts, prompt = tables(5, gen)
    logits = (torch.randn(4, VOCAB_SIZE, generator=gen) * 3).to(dtype)
    packed = params([4, -1, 0, 2])
    expected = logits.clone()
    apply_penalties_ref(expected, counts, prompt, packed)
    actual = logits.to(DEVICE)
    apply_penalties(actual, counts.to(DEVICE), prompt.to(DEVICE), packed.to(DEVICE))
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_bad_shapes_are_refused():
    counts, prompt = tables(2, torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="params"):
        apply_penalties_ref(torch.zeros(3, VOCAB_SIZE), counts, prompt, params([0, 1]))


@pytest.mark.gpu
def test_kernel_on_cuda_matches_ref_at_a_real_vocab():
    gen = torch.Generator().manual_seed(3)
    vocab_size = 128_256
    counts = torch.randint(0, 4, (8, vocab_size), generator=gen, dtype=torch.int32)
    counts *= torch.rand(8, vocab_size, generator=gen) < 0.01
    prompt = torch.rand(8, vocab_size, generator=gen) < 0.01
    logits = torch.randn(4, vocab_size, generator=gen) * 3
    packed = params([7, -1, 0, 3])
    expected = logits.clone()
    apply_penalties_ref(expected, counts, prompt, packed)
    actual = logits.cuda()
    apply_penalties(actual, counts.cuda(), prompt.cuda(), packed.cuda())
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-6, atol=1e-6)
