"""Compile what serving runs before it serves: the attention kernel's variants, then a
request's first steps.

Triton compiles one variant per set of constexprs; the attention launcher picks its tile shape
from the step's longest query and its split-KV segment count from the context lengths, so a
server meeting a new combination mid-run stalls for the compile (about a second each, measured
on an H200). This runs one small launch per variant at start-up, on layer 0's cache and with
inputs laid out as the model lays them out (a query sliced from a fused qkv output), so the
variants compiled are the ones steps will use. Triton's disk cache makes later starts fast.

``warm_up_steps`` then runs two short requests through the runner as the scheduler would
send them (a prompt alone, a prompt beside a decode, decodes with the step before still in
flight), so what compiles or allocates on a first use (the eager logits of a prompt step,
the sampler, the read-back) does so before the first user's request: on an H200 with a
cold Triton cache, the first request's prompt step took 0.55 s, later ones ~8 ms.
"""

from __future__ import annotations

import time

import structlog
import torch

from kernels import attention_configs, paged_attention
from services.worker.model import Transformer
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan

log = structlog.get_logger()

# Longest query of a step: each power of two and one past it, so every tile shape and the
# one-tile-per-sequence switch on either side of it are met.
QUERY_LENS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257]
CONTEXT = 40  # tokens before a warm-up chunk: some earlier context, as after a prefix hit
# A chunk after a context this many times its length splits that context like a decode's
# (``choose_chunk_segments``: a prefix hit's chunk): each tile shape meets every segment count
SPLIT_CONTEXT_RATIO = attention_configs.SPLIT_CHUNK_MIN_CONTEXT_RATIO


@torch.inference_mode()
def warm_up_attention(model: Transformer, block_size: int) -> None:
    started = time.perf_counter()
    attn = model.layers[0].self_attn
    key_cache, value_cache = attn.key_cache, attn.value_cache
    device, dtype = key_cache.device, model.embed_tokens.weight.dtype  # (an FP8 cache's is not q's)
    num_heads, head_dim = attn.num_heads, attn.head_dim
    width = attn.q_size + 2 * attn.kv_size
    num_blocks = -(-(SPLIT_CONTEXT_RATIO + 1) * max(QUERY_LENS) // block_size)

    def launch(q_lens: list[int], seq_lens: list[int], num_segments: int | None = None) -> None:
        num_tokens, num_seqs = sum(q_lens), len(q_lens)
        qkv = torch.randn(num_tokens, width, device=device, dtype=dtype)
        query = qkv[:, :attn.q_size].view(num_tokens, num_heads, head_dim)
        # [num_seqs, num_blocks]: any of the cache's blocks (nothing is written; a small cache
        # is read around again)
        block_tables = (torch.arange(num_blocks, dtype=torch.int32, device=device)
                        % key_cache.shape[0]).repeat(num_seqs, 1)
        query_start_loc = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
        num_decodes = next((i for i, n in enumerate(q_lens) if n > 1), num_seqs)
        paged_attention.paged_attention(
            query, key_cache, value_cache, block_tables,
            torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc, attn.scale,
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), num_decodes=num_decodes,
            num_segments=num_segments, k_scale=attn.k_scale, v_scale=attn.v_scale,
            batch_invariant=model.config.batch_invariant)  # (then: one config, its variants)

    split_query_lens = _one_per_tile_shape(num_heads // attn.num_kv_heads, dtype,
                                           key_cache.dtype == paged_attention.FP8_KV_DTYPE)
    for q_len in QUERY_LENS[1:]:
        launch([q_len], [CONTEXT + q_len])  # chunks alone
        launch([1, 1, q_len], [CONTEXT, CONTEXT, CONTEXT + q_len])  # after decodes
    num_segments = 1
    while num_segments <= attention_configs.MAX_SEGMENTS:  # decodes split along the context
        launch([1, 1], [CONTEXT, CONTEXT + 7], num_segments)
        for q_len in split_query_lens if num_segments > 1 else ():  # chunks after a hit
            launch([q_len], [(SPLIT_CONTEXT_RATIO + 1) * q_len], num_segments)
        num_segments *= 2
    if device.type == "cuda":
        torch.cuda.synchronize()
    log.info("attention_warmed_up", seconds=round(time.perf_counter() - started, 1))


def _one_per_tile_shape(group: int, dtype: torch.dtype, fp8_cache: bool) -> list[int]:
    """The first chunk length of QUERY_LENS for each tile shape (config, and whether a
    sequence fits one tile) a chunk launch can take."""
    seen, query_lens = set(), []
    for q_len in QUERY_LENS[1:]:
        config = attention_configs.default_config(q_len, group, dtype, fp8_cache)
        shape = (config, q_len <= max(1, config.block_m // group))
        if shape not in seen:
            seen.add(shape)
            query_lens.append(q_len)
    return query_lens


WARM_UP_PROMPT_LEN = 20  # a full block and part of one (block sizes up to 16)


def warm_up_steps(runner) -> None:
    """Two requests' first steps on the runner (a ModelRunner of one rank), then both
    forgotten. They use the cache's last blocks: nothing is cached yet, and a request's
    blocks are written before they are read."""
    started = time.perf_counter()
    blocks_per_request = -(-(WARM_UP_PROMPT_LEN + 4) // runner.block_size)
    last = runner.num_blocks
    if last < 2 * blocks_per_request:
        return  # (a tiny test cache)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, WARM_UP_PROMPT_LEN + 1))

    def new(request_id: str, index: int) -> NewRequestData:
        first = last - (index + 1) * blocks_per_request
        return NewRequestData(request_id, prompt, greedy,
                              list(range(first, first + blocks_per_request)))

    plans = [StepPlan(0, [new("warm-a", 0)], [ScheduledRequest("warm-a", len(prompt))]),
             StepPlan(1, [new("warm-b", 1)], [ScheduledRequest("warm-a", 1),
                                               ScheduledRequest("warm-b", len(prompt))])]
    plans += [StepPlan(step_id, [], [ScheduledRequest("warm-a", 1),
                                     ScheduledRequest("warm-b", 1)]) for step_id in (2, 3)]
    for plan in plans:
        runner.submit(plan)
    runner.flush()
    runner.execute(StepPlan(4, [], [], finished_request_ids=["warm-a", "warm-b"]))
    log.info("first_steps_warmed_up", seconds=round(time.perf_counter() - started, 2))
