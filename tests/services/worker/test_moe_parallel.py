"""Mixture-of-Experts blocks over tensor-parallel ranks on the CPU (gloo): experts sliced (TP) or
split whole (``--enable-expert-parallel``), two processes give one process's greedy text (up to
a near-tied token, where summation order may pick the other); the
parts of every expert tensor put back give the whole; expert parallelism on a dense model is
refused."""

from __future__ import annotations

import pytest
import torch

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.model import ModelConfig
from services.worker.tensor_parallel import TensorParallel
from services.worker.weights import fuse_hf_weights, load_model, read_safetensors
from shared.messages import SamplingParams
from shared.models import ModelFiles, resolve_model
from tests.services.worker.moe_checkpoints import build_moe_checkpoint

PROMPTS = [[1, 504, 3458, 282, 1834, 314, 216], [1, 1973, 28, 4418], list(range(200, 231))]


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """3 experts (2 + 1 over two ranks) and a shared expert, one dense layer between."""
    return build_moe_checkpoint(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe",
                                num_experts=3, top_k=2, num_layers=4)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_rank_parts_rebuild_every_expert_tensor(qwen2_moe, expert_parallel):
    config = ModelConfig.from_path(qwen2_moe)
    weights = fuse_hf_weights(read_safetensors(qwen2_moe, torch.device("cpu"), torch.float32),
                              config)
    ranks = [TensorParallel(rank=r, size=2, expert_parallel=expert_parallel) for r in range(2)]
    local = [tp.local_config(config).moe for tp in ranks]
    if expert_parallel:
        assert [(s.first_local_expert, s.local_experts) for s in local] == [(0, 2), (2, 1)]
    for name, tensor in weights.items():
        parts = [tp.shard(name, tensor, config) for tp in ranks]
        if name.endswith("experts.w13_weight") and not expert_parallel:  # gate, up halves
            halves = [p.chunk(2, dim=1) for p in parts]
            gate = torch.cat([h[0] for h in halves], dim=1)
            up = torch.cat([h[1] for h in halves], dim=1)
            assert torch.equal(torch.cat([gate, up], dim=1), tensor)
        elif name.endswith("experts.w2_weight") and not expert_parallel:
            assert torch.equal(torch.cat(parts, dim=2), tensor)
        elif ".experts." in name:
            assert torch.equal(torch.cat(parts), tensor)


def _generate(files: ModelFiles, tensor_parallel_size: int, expert_parallel: bool = False):
    """[(token ids, their logprobs)] of the three prompts, greedy."""
    engine = Engine(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
                    WorkerConfig(device="cpu", kv_cache_memory="2MiB", block_size=8,
                                 tensor_parallel_size=tensor_parallel_size,
                                 enable_expert_parallel=expert_parallel), files)
    try:
        sampling = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                   logprobs=0)] * 3
        completions, _ = engine.generate(PROMPTS, sampling)
        return [(c.output_token_ids, c.logprobs) for c in completions]
    finally:
        engine.close()


NEAR_TIE = 1e-3  # logprob gap two summation orders may swap


def assert_same_greedy(parallel, whole):
    """Each text equals the one rank's up to where both runs chose a near-tied token (the
    ranks' sums are ordered otherwise: a tie may flip there, and the texts part); the
    logprobs before it agree within NEAR_TIE."""
    for (tokens, logprobs), (whole_tokens, whole_logprobs) in zip(parallel, whole, strict=True):
        assert len(tokens) == len(whole_tokens) == 16
        for position, (token, whole_token) in enumerate(zip(tokens, whole_tokens)):
            assert abs(logprobs[position] - whole_logprobs[position]) < NEAR_TIE, position
            if token != whole_token:  # both picked the top: the two were near-tied
                break


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_two_ranks_sliced_or_expert_parallel_give_one_ranks_text(qwen2_moe):
    files = ModelFiles(name="qwen2-moe", path=qwen2_moe)
    whole = _generate(files, 1)
    assert_same_greedy(_generate(files, 2), whole)
    assert_same_greedy(_generate(files, 2, expert_parallel=True), whole)


def test_expert_parallel_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="--enable-expert-parallel needs a Mixture-of-Experts"):
        load_model(resolve_model("smollm2").path, torch.device("cpu"), torch.float32,
                   tp=TensorParallel(expert_parallel=True))
