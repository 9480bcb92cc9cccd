"""The worker's GPU path on a real GPU (run on the device machine: pytest -m gpu): CUDA-graph
decode steps give the tokens eager steps give, and the sampling kernel keeps a seeded request's
tokens independent of its batch."""

from __future__ import annotations

import pytest
import torch

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import ModelFiles

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]




def engine(model_files: ModelFiles, enforce_eager: bool, overlap_steps: str = "auto") -> Engine:
    """fp32: graph and eager steps (and batches of other sizes) may split attention into
    different segments; in fp32 that reorders sums by ~1e-6, never enough to flip a token
    of this near-flat random model, which a bf16 rounding step could."""
    return Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                  WorkerConfig(device="cuda", dtype="float32", kv_cache_memory="64MiB",
                               max_model_len=512, max_num_seqs=16, enforce_eager=enforce_eager,
                               overlap_steps=overlap_steps),
                  model_files)


def prompts(num: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(5, 40_000, (int(n),), generator=generator).tolist()
            for n in torch.randint(3, 90, (num,), generator=generator)]


def test_graph_decode_equals_eager(dummy_model):
    """Graphs on: decodes replay decode graphs and the chunked prompts (64-token steps mixing
    chunks and decodes) piecewise graphs; the same tokens as every step eager."""
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 12
    outputs = {}
    for eager in (False, True):
        llm = engine(dummy_model, eager)
        completions, _ = llm.generate(prompts(12), greedy)
        outputs[eager] = [c.output_token_ids for c in completions]
        mixed_graphs = llm.runner._mixed_graphs
        assert (mixed_graphs is None) == eager
        assert eager or mixed_graphs.num_steps > 0
    assert outputs[False] == outputs[True]


def test_piecewise_graphs_equal_their_pieces_run_uncaptured(dummy_model):
    """Replaying the captured pieces computes what calling them does (same shapes, same
    kernels): the capture holds the right buffers."""
    greedy = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 12
    outputs = {}
    for use_graphs in (True, False):
        llm = engine(dummy_model, enforce_eager=False)
        llm.runner._mixed_graphs.use_graphs = use_graphs
        completions, _ = llm.generate(prompts(12), greedy)
        outputs[use_graphs] = [c.output_token_ids for c in completions]
    assert outputs[True] == outputs[False]


def test_overlapped_steps_equal_one_at_a_time(dummy_model):
    """Step N+1 queued before step N is read back (the default on CUDA) gives the tokens of
    one step at a time, greedy and seeded, with requests leaving at different steps."""
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(6)]
    params += [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
               for i in range(6)]
    outputs = {}
    for overlap in ("on", "off"):
        llm = engine(dummy_model, enforce_eager=False, overlap_steps=overlap)
        completions, _ = llm.generate(prompts(12), params)
        outputs[overlap] = [c.output_token_ids for c in completions]
        assert (llm.runner.num_overlapped_steps > 0) == (overlap == "on")
    assert outputs["on"] == outputs["off"]


def test_seeded_sampling_same_alone_and_in_batch(dummy_model):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    batch_prompts = prompts(8)
    batch_params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, ignore_eos=True)] * 8
    batch_params[3] = seeded
    llm = engine(dummy_model, enforce_eager=False)
    (alone,), _ = llm.generate([batch_prompts[3]], [seeded])
    in_batch, _ = llm.generate(batch_prompts, batch_params)
    assert alone.output_token_ids == in_batch[3].output_token_ids
