"""Pick one next token per row of a logits batch.

``Sampler`` runs a step's sampling: it records raw log-probabilities for requests that asked,
adjusts the logits (logit_bias, min_tokens, the structured-output mask, penalties, min_p), all
vectorized over the rows that need it, then draws with ``sample``.

Greedy rows (temperature 0 or top_k 1) are one vectorised argmax. The other rows are scaled by
temperature, cut by top-k then top-p (in sorted order, vectorised), and each draws its token with
its own ``torch.Generator`` when the request has a seed, so a seeded request gets the same tokens
whatever else is in the batch. Rows without a seed draw from torch's default generator.
On CUDA the non-greedy batch goes to ``kernels/sampling.py`` instead: one launch for every
row, random numbers keyed by (seed, output index), no per-row loop.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kernels.sampling import sample_tokens
from services.worker import ops
from services.worker.penalties import PenaltyTables
from services.worker.transfer import to_device
from shared.messages import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from services.worker.structured import GrammarBank


class Sampler:
    """Per-request sampling state (penalty counts, grammars) and one step's sampling."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 make_grammars: Callable[[], GrammarBank] | None = None) -> None:
        """make_grammars builds the grammar bank on the first structured request (it loads the
        tokenizer); None: this worker refuses structured requests."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.penalties = PenaltyTables(vocab_size, device)
        self.grammars: GrammarBank | None = None
        self._make_grammars = make_grammars

    def add(self, request_id: str, sampling: SamplingParams, token_ids: list[int],
            num_prompt_tokens: int) -> None:
        """A new or resumed request; ``token_ids`` are its prompt then its outputs so far."""
        bad = [t for t in sampling.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: logit_bias token ids {bad} outside the "
                             f"vocabulary of {self.vocab_size}")
        if sampling.has_penalties:
            self.penalties.add(request_id, token_ids[:num_prompt_tokens],
                               token_ids[num_prompt_tokens:])
        if sampling.structured is not None:
            if self.grammars is None:
                if self._make_grammars is None:
                    raise ValueError("this worker has no tokenizer for structured outputs")
                self.grammars = self._make_grammars()
            self.grammars.add(request_id, sampling.structured, token_ids[num_prompt_tokens:])

    def remove(self, request_id: str) -> None:
        self.penalties.remove(request_id)
        if self.grammars is not None:
            self.grammars.remove(request_id)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               output_indices: list[int], generators: list[torch.Generator | None]
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [num_rows, vocab_size], one row per request -> (token ids, logprobs per row).
        The logits are adjusted in place.

        output_indices: per row, how many tokens the request has generated so far.
        """
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        # [num_logprob_rows, vocab_size]: the model's own distribution, before any adjustment
        logprobs = logits[logprob_rows].float().log_softmax(-1) if logprob_rows else None
        # in place: the caller is done with these logits
        logits = self.adjusted(logits, request_ids, params, output_indices)
        token_ids = sample(logits, params, generators, output_indices)
        self.penalties.count(request_ids, token_ids)
        if self.grammars is not None:
            for request_id, token_id in zip(request_ids, token_ids):
                if request_id in self.grammars:
                    self.grammars.accept(request_id, token_id)
        results: list[TokenLogprobs | None] = [None] * len(params)
        if logprobs is not None:
            for i, entry in zip(logprob_rows, token_logprobs(
                    logprobs, [token_ids[i] for i in logprob_rows],
                    [params[i].logprobs for i in logprob_rows])):
                results[i] = entry
        return token_ids, results

    def sample_on_device(self, logits: torch.Tensor, request_ids: list[str],
                         params: list[SamplingParams], output_indices: list[int],
                         generators: list[torch.Generator | None]) -> torch.Tensor:
        """``sample`` for rows whose requests need no host tokens (no logprobs, grammar or
        penalties): the token ids [num_rows] stay on the device, nothing waits for them."""
        logits = self.adjusted(logits, request_ids, params, output_indices)
        if all(p.is_greedy for p in params):
            return ops.greedy_token_ids(logits)
        if logits.is_cuda:
            return sample_with_kernel(logits, params, output_indices)
        return torch.tensor(sample(logits, params, generators, output_indices))

    def adjusted(self, logits: torch.Tensor, request_ids: list[str],
                 params: list[SamplingParams], output_indices: list[int]) -> torch.Tensor:
        """The rows [num_rows, vocab_size] as tokens are drawn from them: logit_bias, the ends
        min_tokens forbids, the grammar's mask, penalties, min_p; in place (pass a copy to
        keep the model's). ``output_indices``: per row, the tokens its request generated
        before the one drawn there."""
        if not any(_adjusts(p) for p in params):
            return logits
        device = logits.device
        # (row, token, value) triples: added biases, and -inf for tokens min_tokens forbids
        biased = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        # min_tokens does not apply under a structured-output grammar: a complete JSON value
        # allows only EOS, and masking that too would leave no token at all
        biased += [(i, t, -math.inf) for i, p in enumerate(params)
                   if output_indices[i] < p.min_tokens and p.structured is None
                   for t in {*self.eos_token_ids, *p.stop_token_ids}]
        if biased:
            if not logits.is_contiguous():
                logits = logits.contiguous()
            vocab_size = logits.shape[1]
            flat_index = to_device(torch.tensor([row * vocab_size + t for row, t, _ in biased]),
                                   device)
            values = to_device(torch.tensor([v for _, _, v in biased], dtype=logits.dtype), device)
            logits.view(-1).index_add_(0, flat_index, values)
        if self.grammars is not None and any(r in self.grammars for r in request_ids):
            self.grammars.apply_bitmask(logits, to_device(self.grammars.fill_bitmask(request_ids),
                                                          device))
        if any(p.has_penalties for p in params):
            self.penalties.apply(logits, request_ids, params)
        if any(p.min_p > 0.0 and not p.is_greedy for p in params):
            # p_i < min_p * p_max  <=>  logit_i < logit_max + temperature * log(min_p);
            # rows without min_p get an offset of -inf, which masks nothing
            offsets = to_device(torch.tensor(  # [num_rows]
                [p.temperature * math.log(p.min_p) if p.min_p > 0.0 and not p.is_greedy
                 else -math.inf for p in params], dtype=logits.dtype), device)
            threshold = logits.max(dim=-1, keepdim=True).values + offsets[:, None]
            logits.masked_fill_(logits < threshold, -math.inf)
        return logits


def _adjusts(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.min_tokens or params.structured is not None
                or params.has_penalties or (params.min_p > 0.0 and not params.is_greedy))


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]
                   ) -> list[TokenLogprobs]:
    """logprobs: [num_rows, vocab_size] log-probabilities; per row the chosen token's and the
    ``num_top[row]`` most likely."""
    device = logprobs.device
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=device)[:, None])[:, 0].tolist()
    max_top = max(num_top)
    top_ids: list[list[int]] = [[] for _ in token_ids]
    top_values: list[list[float]] = [[] for _ in token_ids]
    if max_top > 0:
        values, ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top]
        top_values, top_ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(token_id, value, ids[:k], values[:k])
            for token_id, value, ids, values, k in zip(token_ids, chosen, top_ids, top_values,
                                                       num_top)]


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
        return ops.greedy_token_ids(logits).tolist()
    if logits.is_cuda:
        return sample_with_kernel(logits, params, output_indices or [0] * len(params)).tolist()
    token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)  # [num_rows]
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy_rows:
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
    if random_rows:
        random_params = [params[i] for i in random_rows]
        # [num_random, vocab_size]
        probs = filtered_probs(logits[random_rows].float(), random_params)
        for row, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[row], 1, generator=generators[i])[0]
    return token_ids.tolist()


def sample_with_kernel(logits: torch.Tensor, params: list[SamplingParams],
                       output_indices: list[int]) -> torch.Tensor:
    """Every row in one launch (kernels/sampling.py): no per-row loop, no sync; returns the
    token ids [num_rows] on the device. A row without a seed gets a fresh random one."""
    device = logits.device
    # two host-to-device copies for every row's parameters
    floats = to_device(torch.tensor([[0.0 if p.is_greedy else p.temperature for p in params],
                                     [p.top_p for p in params]], dtype=torch.float32), device)
    ints = to_device(torch.tensor([
        [p.top_k for p in params],
        [p.seed if p.seed is not None else random.getrandbits(62) for p in params],
        output_indices], dtype=torch.int64), device)
    return sample_tokens(logits, floats[0], ints[0], floats[1], ints[1], ints[2],
                         apply_filters=any(p.top_k > 0 or p.top_p < 1.0 for p in params))



def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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


def chunk_prompt_logprobs(requests: list[tuple[str, object]], chunks: list,
                          first_rows: list[int], logits: torch.Tensor
                          ) -> dict[str, list[TokenLogprobs]]:
    """Logprobs of the prompt tokens whose predicting positions ran this step, per request
    (the logits at position p give token p + 1). ``requests``: per step chunk, (request id,
    its RequestState); ``first_rows``: per chunk, its first row of ``logits``."""
    result: dict[str, list[TokenLogprobs]] = {}
    for (request_id, state), chunk, row in zip(requests, chunks, first_rows):
        if chunk.num_logprob_rows:
            rows = logits[row:row + chunk.num_logprob_rows].float().log_softmax(-1)
            next_ids = state.token_ids[chunk.start + 1:chunk.start + 1 + chunk.num_logprob_rows]
            result[request_id] = token_logprobs(
                rows, next_ids, [state.sampling.prompt_logprobs] * len(next_ids))
    return result
