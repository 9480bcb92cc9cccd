"""``--quantization fp8`` on a real GPU (run on the device machine: pytest -m gpu): the FP8
model's teacher-forced logits follow bf16's, and its steps in CUDA graphs give the tokens its
eager steps give."""

from __future__ import annotations

import pytest
import torch

from cli.engine import Engine
from kernels.paged_attention_ref import allocate_kv_cache
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.weights import load_model
from shared.messages import SamplingParams
from tests.services.worker.conftest import dummy_preset
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return dummy_preset(tmp_path_factory, "qwen3-0.6b")


@torch.inference_mode()
def test_fp8_logits_follow_bf16_at_prefill_and_decode_sizes(qwen3):
    """Qwen3-0.6B's shapes (scaled FP8 GEMMs at every size): a 40-token prompt chunk, then
    one decode; cosine of every position's logits with bf16's."""
    path = qwen3.path
    seq = torch.randint(100, 40_000, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    steps, block_tables = [[(seq[:40], 0)], [(seq[40:], 40)]], [[3, 0, 6]]
    logits = {}
    for quantization in ("none", "fp8"):
        model = load_model(path, CUDA, torch.bfloat16, quantization=quantization)
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 8, BLOCK_SIZE * 4,
                                              config.num_kv_heads, config.head_dim,
                                              torch.bfloat16, CUDA))
        logits[quantization] = torch.cat(run_chunks(model, steps, block_tables, CUDA)).float()
        del model
    cosine = torch.nn.functional.cosine_similarity(logits["fp8"], logits["none"], dim=-1)
    assert cosine.min() > 0.98, cosine


def test_fp8_graph_decode_equals_eager(qwen3):
    """Qwen3-0.6B through the engine: steps in CUDA graphs (the scaled FP8 GEMMs and their
    activation quantization captured) give the tokens eager steps give."""
    model_files = qwen3
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40_000, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 90, (8,), generator=generator)]
    greedy = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(prompts)
    outputs = {}
    for eager in (False, True):
        engine = Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        WorkerConfig(device="cuda", dtype="bfloat16", quantization="fp8",
                                     kv_cache_memory="256MiB", max_model_len=512,
                                     max_num_seqs=16, max_num_batched_tokens=256,
                                     enforce_eager=eager), model_files)
        completions, _ = engine.generate(prompts, greedy)
        outputs[eager] = [c.output_token_ids for c in completions]
        del engine
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]
