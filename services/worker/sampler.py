"""Pick one next token per row of a logits batch.

Greedy rows (temperature 0 or top_k 1) are one vectorised argmax. The other rows are scaled by
temperature, cut by top-k then top-p (in sorted order, vectorised), and each draws its token with
its own ``torch.Generator`` when the request has a seed, so a seeded request gets the same tokens
whatever else is in the batch. Rows without a seed draw from torch's default generator.
On CUDA the non-greedy batch goes to ``kernels/sampling.py`` instead: one launch for every
row, random numbers keyed by (seed, output index), no per-row loop.
"""

from __future__ import annotations

import random

import torch

from kernels.sampling import sample_tokens
from shared.messages import SamplingParams


def make_generator(sampling: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A request's own random stream, or None (default stream) when it has no seed or is greedy."""
    if sampling.seed is None or sampling.is_greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed)
    return generator


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           output_indices: list[int] | None = None) -> list[int]:
    """logits: [num_rows, vocab_size]; params and generators: one per row -> token ids.

    output_indices: per row, how many tokens its request has generated; on CUDA a seeded
    draw depends only on (seed, output index) through the sampling kernel's counter-based
    random numbers (the CPU path re-seeds the row's generator to the same effect).
    """
    if all(p.is_greedy for p in params):  # the common batch: one argmax, no row gathers
        return logits.argmax(dim=-1).tolist()
    if logits.is_cuda:
        return sample_with_kernel(logits, params, output_indices or [0] * len(params))
    token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # [num_rows]
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy_rows:
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    if random_rows:
        random_params = [params[i] for i in random_rows]
        # [num_random, vocab_size]
        probs = _filtered_probs(logits[random_rows].float(), random_params)
        for row, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[row], 1, generator=generators[i])[0]
    return token_ids.tolist()


def sample_with_kernel(logits: torch.Tensor, params: list[SamplingParams],
                       output_indices: list[int]) -> list[int]:
    """Every row in one launch (kernels/sampling.py): no per-row loop, one sync to read the
    tokens. A row without a seed gets a fresh random one."""
    device = logits.device
    temperatures = torch.tensor([0.0 if p.is_greedy else p.temperature for p in params])
    seeds = [p.seed if p.seed is not None else random.getrandbits(62) for p in params]
    token_ids = sample_tokens(
        logits, temperatures.to(device), torch.tensor([p.top_k for p in params],
                                                      dtype=torch.int32).to(device),
        torch.tensor([p.top_p for p in params]).to(device),
        torch.tensor(seeds, dtype=torch.int64).to(device),
        torch.tensor(output_indices, dtype=torch.int64).to(device),
        apply_filters=any(p.top_k > 0 or p.top_p < 1.0 for p in params))
    return token_ids.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p. logits: [num_rows, vocab_size] fp32 -> probabilities."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device)  # [num_rows]
    logits = logits / temperatures[:, None]
    if all(p.top_k <= 0 and p.top_p >= 1.0 for p in params):
        return torch.softmax(logits, dim=-1)
    # [num_rows, vocab_size]; stable, so ties keep argmax's choice (the lowest id) first
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                         device=device)  # [num_rows]
    ranks = torch.arange(vocab_size, device=device)[None, :]  # [1, vocab_size]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)  # [num_rows]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability of higher-ranked tokens
    # keep a token while the tokens before it hold less than top_p (the first is always kept)
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0),
                                              float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter_(-1, sorted_ids, sorted_logits)
    return torch.softmax(filtered, dim=-1)
