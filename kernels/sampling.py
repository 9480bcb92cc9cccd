"""Batched next-token sampling on the device, with no host sync (torch + Triton).

Per row: temperature (0 = greedy), then top-k, then top-p, then one draw. The filters run
vectorized in torch (one sort per batch, skippable when the caller knows no row filters). The
draw is the Gumbel-max trick in a Triton kernel: token = argmax over the vocab of
``logit_i / temperature + g_i`` with ``g_i = -log(-log(u_i))``, which picks token i with
probability ``softmax(logits / temperature)_i`` (equivalently ``argmax p_i / E_i`` with
``E_i = -log(u_i)`` exponential). ``u_i`` comes from Philox keyed by the row's seed, with counter
``(i, offset_lo, offset_hi, 0)``: a row's draw depends only on (seed, offset, its logits and
parameters), never on the batch around it or on how the vocab is split among programs. Callers
give unseeded requests a random seed of their own, and ``offsets`` the request's draw index (e.g.
its number of generated tokens), so a seeded request replays exactly, also after a preemption.

The vocab is split among programs (``SPLIT_SIZE`` entries each); each writes its best score and
token id, and a torch argmax over the splits picks the winner (the lowest id among equal scores,
as ``torch.argmax`` does, so greedy rows equal ``logits.argmax(-1)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_SIZE = 4096  # vocab entries per program (a power of two)
BLOCK_SIZE = 1024  # vocab entries per loop step (a power of two)


@triton.jit
def _sample_kernel(
    logits_ptr, temperatures_ptr, seeds_ptr, offsets_ptr, partial_scores_ptr, partial_ids_ptr,
    logits_stride_row, vocab_size, num_splits,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
):
    """Program (row, split): the split's best score and its lowest token id among equals.
    GREEDY: every row is greedy (no parameters are read: the pointers may be any tensor)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_logits = logits_ptr + row.to(tl.int64) * logits_stride_row
    cols = tl.arange(0, BLOCK)
    if not GREEDY:
        temperature = tl.load(temperatures_ptr + row)
        seed = tl.load(seeds_ptr + row)
        draw = tl.load(offsets_ptr + row).to(tl.int64)
        zeros = tl.zeros([BLOCK], dtype=tl.uint32)
        draw_lo = zeros + (draw & 0xFFFFFFFF).to(tl.uint32)  # [BLOCK] Philox counter words
        draw_hi = zeros + ((draw >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best_scores = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_ids = split * SPLIT + cols
    for start in range(0, SPLIT, BLOCK):
        ids = split * SPLIT + start + cols  # [BLOCK]
        logits = tl.load(row_logits + ids, mask=ids < vocab_size,
                         other=float("-inf")).to(tl.float32)
        if GREEDY:
            scores = logits
        else:
            if temperature == 0.0:
                scores = logits
            else:
                bits, _, _, _ = tl.philox(seed, ids.to(tl.uint32), draw_lo, draw_hi, zeros)
                # 23 random bits -> u in [2^-24, 1 - 2^-24], exactly representable: never 0 or 1
                uniform = ((bits >> 9).to(tl.int32).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                scores = logits / temperature - tl.log(-tl.log(uniform))
        better = scores > best_scores  # strict: the earliest id keeps a tie
        best_scores = tl.where(better, scores, best_scores)
        best_ids = tl.where(better, ids, best_ids)
    best_score = tl.max(best_scores, axis=0)
    best_id = tl.min(tl.where(best_scores == best_score, best_ids, vocab_size), axis=0)
    tl.store(partial_scores_ptr + row * num_splits + split, best_score)
    tl.store(partial_ids_ptr + row * num_splits + split, best_id)


@triton.jit(do_not_specialize_on_alignment=["out_ptr"])  # (out may be a caller's view)
def _best_split_kernel(partial_scores_ptr, partial_ids_ptr, out_ptr, num_splits,
                       BLOCK_SPLITS: tl.constexpr):
    """Program per row: the token id of its best split (the first of equal scores: the splits
    are in id order, so the lowest id of the row's equal best, as torch.argmax)."""
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = splits < num_splits
    scores = tl.load(partial_scores_ptr + row * num_splits + splits, mask=mask,
                     other=float("-inf"))
    best = tl.min(tl.where(mask & (scores == tl.max(scores, axis=0)), splits, BLOCK_SPLITS),
                  axis=0)
    best = tl.minimum(best, num_splits - 1)  # a row of -inf everywhere: its first split
    token_id = tl.load(partial_ids_ptr + row * num_splits + best)
    tl.store(out_ptr + row, token_id.to(tl.int64))


def _filter_top_k_top_p(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                        top_ps: torch.Tensor) -> torch.Tensor:
    """The logits (fp32) with every token outside its row's top-k, then top-p set, at -inf.

    Top-p is taken over the temperature-scaled probabilities renormalized after top-k; a token is
    kept while the tokens ranked before it hold less than top_p (the top token always stays).
    """
    logits = logits.float()  # [num_rows, vocab_size]
    vocab_size = logits.shape[-1]
    # [num_rows, vocab_size]; stable, so tied tokens keep argmax's order (lowest id first)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=logits.device)[None, :]  # [1, vocab_size]
    top_ks = top_ks.long()[:, None]  # [num_rows, 1]
    top_ks = torch.where((top_ks > 0) & (top_ks < vocab_size), top_ks, vocab_size)
    cut = ranks >= top_ks
    top_ps = top_ps.float()[:, None]  # [num_rows, 1]
    scale = torch.where(temperatures > 0, temperatures, 1.0).float()[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")) / scale, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut |= (mass_before >= top_ps) & (top_ps < 1.0) & (ranks > 0)
    return logits.scatter(-1, sorted_ids, sorted_logits.masked_fill(cut, float("-inf")))


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                  top_ps: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, *,
                  apply_filters: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """One next token per row, drawn on the logits' device without a host sync.

    logits: [num_rows, vocab_size] (fp32, bf16 or fp16; vocab dim contiguous)
    temperatures: [num_rows] fp32, 0 = greedy (argmax of the raw logits)
    top_ks: [num_rows] int, 0 or >= vocab_size = off
    top_ps: [num_rows] fp32, 1.0 = off
    seeds: [num_rows] int64, the row's random stream
    offsets: [num_rows] int64, the row's draw index within that stream
    apply_filters: False skips the top-k/top-p sort; pass it only when no row filters (the
    caller knows from its host-side parameters), True is always right
    out: optional [num_rows] int64
    returns: [num_rows] int64 token ids
    """
    num_rows, vocab_size = logits.shape
    for name, t in (("temperatures", temperatures), ("top_ks", top_ks), ("top_ps", top_ps),
                    ("seeds", seeds), ("offsets", offsets)):
        if t.shape != (num_rows,) or t.device != logits.device:
            raise ValueError(f"{name}: {tuple(t.shape)} on {t.device}, want ({num_rows},) on "
                             f"{logits.device}")
    if logits.stride(-1) != 1:
        raise ValueError("logits: the vocab dim must be contiguous")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if apply_filters:
        logits = _filter_top_k_top_p(logits, temperatures, top_ks, top_ps)
    return _draw(logits, out, temperatures.float(), seeds.long(), offsets.long(), greedy=False)


def greedy_token_ids(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` of CUDA logits [num_rows, vocab_size] (vocab dim contiguous) in
    two launches: the vocab split among programs, then each row's best split (torch's argmax
    reduces a row in one block: 27 us for a 128k vocab at batch 1 on an H200). The lowest id
    among equal logits, as torch.argmax; a NaN never wins (torch.argmax picks it).
    out: optional [num_rows] int64. returns: [num_rows] int64 token ids, without a host sync."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits: [num_rows, vocab_size] with the vocab dim contiguous, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if out is None:
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    return _draw(logits, out, logits, logits, logits, greedy=True)


def _draw(logits: torch.Tensor, out: torch.Tensor, temperatures: torch.Tensor,
          seeds: torch.Tensor, offsets: torch.Tensor, greedy: bool) -> torch.Tensor:
    """The two launches: every split's best (``_sample_kernel``), then every row's."""
    num_rows, vocab_size = logits.shape
    block = min(BLOCK_SIZE, triton.next_power_of_2(vocab_size))
    split = max(block, min(SPLIT_SIZE, triton.next_power_of_2(vocab_size)))
    num_splits = triton.cdiv(vocab_size, split)
    # [num_rows, num_splits]: each split's best (Gumbel) score and its token id
    partial_scores = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    partial_ids = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    _sample_kernel[(num_rows, num_splits)](
        logits, temperatures, seeds, offsets, partial_scores, partial_ids,
        logits.stride(0), vocab_size, num_splits,
        SPLIT=split, BLOCK=block, GREEDY=greedy,
    )
    target = out if out.is_contiguous() else torch.empty_like(out)
    _best_split_kernel[(num_rows,)](partial_scores, partial_ids, target, num_splits,
                                    BLOCK_SPLITS=triton.next_power_of_2(num_splits))
    return out if target is out else out.copy_(target)


def sampling_probs_ref(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                       top_ps: torch.Tensor) -> torch.Tensor:
    """The distribution sample_tokens draws from, row by row in plain torch.

    returns: [num_rows, vocab_size] fp32 probabilities (one-hot on the argmax for greedy rows)
    """
    num_rows, vocab_size = logits.shape
    probs = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    for row in range(num_rows):
        row_logits, temperature = logits[row].float(), float(temperatures[row])
        if temperature == 0.0:
            probs[row, row_logits.argmax()] = 1.0
            continue
        scaled = row_logits / temperature
        keep = torch.argsort(scaled, descending=True, stable=True)  # token ids by rank
        top_k = int(top_ks[row])
        if 0 < top_k < vocab_size:
            keep = keep[:top_k]
        top_p = float(top_ps[row])
        if top_p < 1.0:
            kept_probs = torch.softmax(scaled[keep], dim=0)
            mass_before = kept_probs.cumsum(0) - kept_probs
            keep = keep[:max(1, int((mass_before < top_p).sum()))]
        probs[row, keep] = torch.softmax(scaled[keep], dim=0)
    return probs


def draw_seed(seed: int, output_index: int) -> int:
    """The torch generator seed of a seeded request's draw number ``output_index``: it depends
    on those two only, so a draw is the same whatever the batch, and a request recomputed
    after preemption draws what it drew before. The worker's CPU path and sample_tokens_ref
    both seed by it."""
    return (seed * 1_000_003 + output_index) % 2**63


def sample_tokens_ref(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                      top_ps: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor
                      ) -> torch.Tensor:
    """Same distribution as sample_tokens, drawn with torch.multinomial from a generator seeded
    by (seed, offset) per row (so also batch-independent, but other tokens than the kernel's).

    returns: [num_rows] int64
    """
    probs = sampling_probs_ref(logits, temperatures, top_ks, top_ps)
    token_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for row in range(logits.shape[0]):
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(draw_seed(int(seeds[row]), int(offsets[row])))
        token_ids[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
    return token_ids
