"""The draft model on a real GPU (pytest -m gpu): its decode passes replay CUDA graphs, the
memory profile sizes its cache and graphs, and the served model drafting for itself gives
the tokens of plain decoding with every draft kept, at batch sizes 1 to 12."""

from __future__ import annotations

import json

import pytest
import torch

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import ModelFiles

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def engine(model_files: ModelFiles, spec: str) -> Engine:
    """fp32, as test_runner_gpu.py: no bf16 rounding flips this near-flat random model."""
    return Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                  speculative_config=spec),
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
        run = engine(dummy_model, config)
        outputs[name] = [c.output_token_ids for batch in batches
                         for c in run.generate(batch, greedy * len(batch))[0]]
    drafts = run.runner.drafts
    assert drafts.graphs is not None and drafts.graphs.graphs  # its decode passes' graphs
    assert outputs["drafted"] == outputs["plain"]
    drafter = run.scheduler.drafter
    assert drafter.num_accepted_drafts == drafter.num_draft_tokens > 12 * 4
