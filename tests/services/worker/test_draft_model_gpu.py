"""Speculative decoding on a real GPU (pytest -m gpu): the draft model's decode passes replay
CUDA graphs, the memory profile sizes its cache and graphs, and the served model drafting for
itself gives the tokens of plain decoding with every draft kept, at batch sizes 1 to 12;
verify steps (a token and K drafts a request) replay a graph that computes what the eager
forward computes."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from services.worker.step_inputs import SequenceChunk, build_step_inputs, logits_layout
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import ModelFiles
from shared.sections.speculative import SpeculativeConfig, parse_speculative_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def engine(model_files: ModelFiles, spec: str) -> Engine:
    """fp32, as test_runner_gpu.py: no bf16 rounding flips this near-flat random model."""
    return Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                  speculative_config=parse_speculative_config(spec)),
                  WorkerConfig(device="cuda", dtype="float32", kv_cache_memory="auto",
                               gpu_memory_utilization=0.3, max_model_len=512, max_num_seqs=16,
                               max_num_batched_tokens=256),
                  model_files)


def test_the_served_model_drafting_for_itself_on_the_gpu(dummy_model):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40_000, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 90, (12,), generator=generator)]
    batches = [prompts[:1], prompts[1:4], prompts[4:]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    spec = json.dumps({"method": "draft_model", "model": str(dummy_model.path),
                       "num_speculative_tokens": 4, "disable_by_batch_size": 0})
    outputs = {}
    for name, config in (("plain", ""), ("drafted", spec)):
        run = None  # the engine before gives its memory back first: each takes 30% for KV
        gc.collect()
        torch.cuda.empty_cache()
        run = engine(dummy_model, config)
        outputs[name] = [c.output_token_ids for batch in batches
                         for c in run.generate(batch, greedy * len(batch))[0]]
    proposer = run.runner.proposer
    assert proposer.graphs is not None and proposer.graphs.graphs  # its decode passes' graphs
    assert outputs["drafted"] == outputs["plain"]
    books = run.scheduler.draft_books
    assert books.num_accepted_drafts == books.num_draft_tokens > 12 * 4


@torch.inference_mode()
def test_a_verify_graph_computes_what_the_eager_forward_computes(dummy_model):
    """Three requests, each its last token and 3 drafts (a bucket of 4 sequences: one of
    padding): the verify graph's logits are the eager forward's."""
    runner = build_runner(WorkerConfig(device="cuda", dtype="float32", kv_cache_memory="64MiB",
                                      max_model_len=512, max_num_seqs=8,
                                      speculative_config=SpeculativeConfig(
                                          num_speculative_tokens=3)), dummy_model)
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = {f"r{i}": list(range(5 + i, 40 + 9 * i)) for i in range(3)}
    blocks = {rid: list(range(4 * i, 4 * i + 4)) for i, rid in enumerate(prompts)}
    runner.execute(StepPlan(0, [NewRequestData(rid, p, greedy, blocks[rid])
                                for rid, p in prompts.items()],
                            [ScheduledRequest(rid, len(p)) for rid, p in prompts.items()]))
    chunks = [SequenceChunk(token_ids=runner._requests[rid].token_ids[-1:] + [7, 8, 9],
                            start=len(p), block_table=blocks[rid], sample=True, num_drafts=3)
              for rid, p in prompts.items()]
    layout = logits_layout(chunks)
    input_ids, positions, metadata = build_step_inputs(chunks, 16, torch.device("cuda"), layout)
    graphs = runner._whole_graph(len(input_ids), 3, 4, len(layout.token_indices))
    assert graphs is runner._verify_graphs and graphs.bucket_for(3) == 4
    from_graph = graphs.run(input_ids, positions, metadata).clone()  # [12, vocab_size]
    eager = runner.model(input_ids, positions, metadata)
    torch.testing.assert_close(from_graph, eager, rtol=1e-4, atol=1e-4)
