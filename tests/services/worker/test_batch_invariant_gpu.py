"""--batch-invariant on a real GPU (pytest -m gpu): a request's greedy tokens do not depend on
what else its steps hold. In bf16, on a random Qwen3-0.6B (near-flat logits, where any change
of rounding flips a near tie), each prompt alone against all of them at once, and n-gram
speculation (verify steps of up to 5 tokens a request, over 16 rows) against none."""

from __future__ import annotations

import pytest
import torch

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from tests.services.worker.conftest import dummy_preset
from shared.sections.speculative import parse_speculative_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}'


def _generate(model_files, spec: str, batches: list[list[list[int]]]) -> list[list[int]]:
    engine = Engine(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024,
                                    speculative_config=parse_speculative_config(spec)),
                    WorkerConfig(device="cuda", dtype="bfloat16", max_model_len=1024,
                                 max_num_seqs=32, max_num_batched_tokens=1024,
                                 kv_cache_memory="2GiB", batch_invariant=True),
                    model_files)
    try:
        outputs = []
        for prompts in batches:
            completions, _ = engine.generate(prompts, [SamplingParams(
                temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts))
            outputs += [c.output_token_ids for c in completions]
        return outputs
    finally:
        engine.close()


def test_greedy_tokens_alone_batched_and_speculated_are_equal(tmp_path_factory):
    model_files = dummy_preset(tmp_path_factory, "qwen3-0.6b")
    generator = torch.Generator().manual_seed(1)
    prompts = []
    for n in torch.randint(4, 120, (24,), generator=generator).tolist():
        phrase = torch.randint(100, 30_000, (max(2, n // 4),), generator=generator).tolist()
        prompts.append((phrase * 4)[:n])  # repeats: n-gram lookup finds drafts
    alone = _generate(model_files, "", [[p] for p in prompts[:8]])
    together = _generate(model_files, "", [prompts])
    assert together[:8] == alone
    speculated = _generate(model_files, NGRAM, [prompts])
    assert speculated == together
