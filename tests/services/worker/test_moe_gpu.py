"""Mixture-of-Experts models on a real GPU (pytest -m gpu): the Triton path's logits against the
CPU reference on the same weights, padded CUDA-graph rows routed to no expert (the experts'
token counters), and the dummy Qwen3-30B-A3B's greedy tokens alone and inside a batch of 64
under --batch-invariant."""

from __future__ import annotations

import json

import pytest
import torch

from cli.engine import Engine
from kernels.paged_attention_ref import allocate_kv_cache
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.moe import take_expert_counts
from services.worker.runner_build import build_runner
from services.worker.weights import load_model
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import DUMMY_MARKER, ModelFiles
from tests.services.worker.conftest import dummy_preset
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
SMALL_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
             "norm_topk_prob": True, "mlp_only_layers": [2], "vocab_size": 49152,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "tie_word_embeddings": False, "eos_token_id": None}


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory) -> ModelFiles:
    path = tmp_path_factory.mktemp("small-moe")
    (path / "config.json").write_text(json.dumps(SMALL_MOE))
    (path / DUMMY_MARKER).write_text("random weights\n")
    return ModelFiles(name="small-moe", path=path)


@torch.inference_mode()
def test_triton_moe_logits_match_the_cpu_reference(small_moe):
    """The same random weights (drawn on the CPU, copied over) in fp32: a 37-token prompt
    chunk, a second chunk and a decode; every token's logits close to the CPU path's."""
    cpu = load_model(small_moe.path, torch.device("cpu"), torch.float32)
    cuda = load_model(small_moe.path, CUDA, torch.float32)
    cuda.load_state_dict({name: t.to(CUDA) for name, t in cpu.state_dict().items()})
    seq = torch.randint(100, 40_000, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    steps = [[(seq[:37], 0)], [(seq[37:44], 37)], [(seq[44:], 44)]]
    block_tables = [list(range(20, 8, -1))]
    logits = []
    for model, device in ((cpu, torch.device("cpu")), (cuda, CUDA)):
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 24, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim,
                                              torch.float32, device))
        logits.append(torch.cat(run_chunks(model, steps, block_tables, device)).cpu())
    torch.testing.assert_close(logits[1], logits[0], atol=2e-3, rtol=2e-3)
    assert logits[1].argmax(-1).tolist() == logits[0].argmax(-1).tolist()


def test_padded_graph_rows_route_to_no_expert(small_moe):
    """Three requests: their prompts in one step (a piecewise graph's bucket, padded), then
    decodes of 3 rows in the bucket of 4. Every sparse layer's counters hold exactly the real
    rows' top-k pairs: the padded rows routed nowhere."""
    runner = build_runner(WorkerConfig(device="cuda", dtype="bfloat16", block_size=16,
                                       kv_cache_memory="256MiB", max_num_seqs=8),
                          small_moe)
    runner.expert_counts.period_s = float("inf")  # (no report takes the counts meanwhile)
    take_expert_counts(runner.model)  # (start-up's routing)
    prompts = [list(range(100, 105)), list(range(200, 209)), list(range(300, 313))]
    ids = [f"r{i}" for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runner.execute(StepPlan(0, [NewRequestData(r, p, params, [2 * i, 2 * i + 1]) for i, (r, p)
                                in enumerate(zip(ids, prompts))],
                            [ScheduledRequest(r, len(p)) for r, p in zip(ids, prompts)]))
    num_decodes = 5
    for step in range(1, num_decodes + 1):
        runner.execute(StepPlan(step, [], [ScheduledRequest(r, 1) for r in ids]))
    assert runner._graphs is not None and runner._graphs.bucket_for(3) == 4
    counts = take_expert_counts(runner.model)
    num_rows = sum(map(len, prompts)) + 3 * num_decodes
    top_k = SMALL_MOE["num_experts_per_tok"]
    assert len(counts) == 3  # layer 2 is dense
    assert [sum(layer) for layer in counts] == [num_rows * top_k] * 3


def _greedy(model_files, batches, **worker):
    engine = Engine(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
                    WorkerConfig(device="cuda", dtype="bfloat16", max_model_len=1024,
                                 max_num_seqs=64, max_num_batched_tokens=2048, **worker),
                    model_files)
    try:
        outputs = []
        for prompts in batches:
            completions, _ = engine.generate(prompts, [SamplingParams(
                temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts))
            outputs += [c.output_token_ids for c in completions]
        return outputs
    finally:
        engine.close()


def test_qwen3_30b_a3b_alone_equals_inside_a_batch_of_64_under_batch_invariant(
        tmp_path_factory):
    model_files = dummy_preset(tmp_path_factory, "qwen3-30b-a3b")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 40_000, (n,), generator=generator).tolist()
               for n in torch.randint(3, 200, (64,), generator=generator).tolist()]
    outputs = _greedy(model_files, [[p] for p in prompts[:6]] + [prompts],
                      kv_cache_memory="8GiB", batch_invariant=True)
    alone, together = outputs[:6], outputs[6:]
    assert together[:6] == alone
