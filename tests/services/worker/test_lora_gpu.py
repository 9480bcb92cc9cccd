"""LoRA on CUDA through kernels/lora.py inside the CUDA graphs (issue 50, deliverable 2; run
on the device: pytest -m gpu): the greedy text of requests of several adapters and of the
base model in the same steps equals the eager torch path's on CUDA and flotilla's CPU
reference (whose equality with transformers + PEFT test_lora.py and
test_lora_kernel_path.py check), with adapters evicted from their slots while steps are in
flight; base-only steps replay the graphs captured without LoRA, bitwise LoRA off's.

No peft here (the device may lack it): the adapters are benchmarks/gpu/dummy_loras.py's, on
a tiny Llama saved by transformers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.gpu.dummy_loras import write_adapter
from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.model_config import ModelConfig
from services.worker.step_inputs import SequenceChunk, build_step_inputs, logits_layout
from shared.messages import SamplingParams
from shared.models import ModelFiles
from tests.cli.test_engine import TINY

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RANKS = {"r8": 8, "r16": 16, "r4": 4}
NUM_NEW_TOKENS = 10
BLOCK_SIZE = 8
# (prompt, adapter): three adapters through two slots, and the base model
REQUESTS = [(0, "r8"), (1, ""), (2, "r16"), (0, "r4"), (3, "r8"), (0, ""), (1, "r16"),
            (2, "r4"), (3, "")]
PROMPTS = [[1 + (11 * i + 3 * k) % 250 for k in range(5 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    """(base ModelFiles, {name: directory})."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("lora-gpu")
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(root / "base", safe_serialization=True)
    config = ModelConfig.from_path(root / "base")
    dirs = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        dirs[name] = root / name
        write_adapter(dirs[name], config, rank, seed, str(root / "base"), b_std=0.5)
    return ModelFiles(name="tiny-llama", path=root / "base"), dirs


def lora_engine(model_files, dirs, **worker_knobs) -> Engine:
    knobs = dict(kv_cache_memory="8MiB", block_size=BLOCK_SIZE, enable_lora=True, max_loras=2,
                 lora_modules=",".join(f"{n}={p}" for n, p in dirs.items()),
                 max_num_seqs=8, max_num_batched_tokens=64) | worker_knobs
    return Engine(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
                  WorkerConfig(**knobs), model_files)


def run(engine, requests=REQUESTS, logprobs=None) -> list:
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=logprobs)
    completions, _ = engine.generate([PROMPTS[i] for i, _ in requests], [greedy] * len(requests),
                                     [name for _, name in requests])
    return [(c.output_token_ids, c.logprobs) if logprobs else c.output_token_ids
            for c in completions]


class CountedReplays:
    """A captured graph whose replays are counted."""

    def __init__(self, graph, counts: list[int]):
        self.graph, self.counts = graph, counts

    def replay(self) -> None:
        self.counts[0] += 1
        self.graph.replay()


def count_lora_replays(runner) -> tuple[list[int], list[int]]:
    """Counters of the decode and piecewise graphs' replays with LoRA's deltas."""
    decode, mixed = [0], [0]
    runner._graphs.lora_graphs = {bucket: CountedReplays(graph, decode)
                                  for bucket, graph in runner._graphs.lora_graphs.items()}
    pieces = runner._mixed_graphs.lora_graphs
    for bucket, graphs in pieces.items():
        pieces[bucket] = [CountedReplays(graph, mixed) for graph in graphs]
    return decode, mixed


def test_graphs_with_the_deltas_equal_the_eager_torch_path_and_the_cpu(tiny_adapters):
    """fp32 (a rounding step of bf16 could flip a token of this near-flat random model):
    decode steps replay the decode graphs captured with LoRA, mixed steps (24-token budget:
    chunks beside decodes) the piecewise ones; steps queued behind the one in flight
    (overlap, CUDA's default) while three adapters share two slots."""
    model_files, dirs = tiny_adapters
    reference = run(lora_engine(model_files, dirs, device="cpu", dtype="float32"))
    assert len({tuple(reference[i]) for i in (0, 3, 5)}) == 3, "adapters must change the text"
    eager = lora_engine(model_files, dirs, device="cuda", dtype="float32", enforce_eager=True)
    eager.runner.lora.batch.lora_rows = None  # (the torch path: the segments' ops)
    assert run(eager) == reference
    del eager
    graphs = lora_engine(model_files, dirs, device="cuda", dtype="float32")
    runner = graphs.runner
    assert sorted(runner._graphs.lora_graphs) == sorted(runner._graphs.graphs)
    decode, mixed = count_lora_replays(runner)
    assert run(graphs) == reference
    assert decode[0] > 0 and mixed[0] > 0 and runner.num_overlapped_steps > 0


def step_logits(runner, requests) -> torch.Tensor:
    """Every position's logits [num_tokens, vocab] of one eager step of ``requests``' whole
    prompts (blocks from 0)."""
    chunks, first = [], 0
    for index, _ in requests:
        num_blocks = -(-len(PROMPTS[index]) // BLOCK_SIZE)
        chunks.append(SequenceChunk(token_ids=list(PROMPTS[index]), start=0, sample=True,
                                    block_table=list(range(first, first + num_blocks)),
                                    num_logprob_rows=len(PROMPTS[index]) - 1))
        first += num_blocks
    layout = logits_layout(chunks)
    input_ids, positions, metadata = build_step_inputs(chunks, BLOCK_SIZE, runner._device,
                                                       layout)
    runner.lora.begin([SimpleNamespace(lora_name=name) for _, name in requests], chunks, [])
    try:
        with torch.inference_mode():
            return runner.model(input_ids, positions, metadata).float()
    finally:
        runner.lora.end()


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_bf16_kernels_stay_near_the_torch_path(tiny_adapters, quantization):
    """bf16, one step mixing adapters and the base model: the kernels round once where the
    torch ops round twice, so their deltas agree to bf16's precision, not bitwise; base
    rows are bitwise. The same over FP8 base weights (--quantization fp8: the slots stay in
    bf16, the deltas add to the FP8 projections' outputs)."""
    model_files, dirs = tiny_adapters
    requests = [(0, "r8"), (2, "r16"), (1, ""), (3, "r8")]
    runner = lora_engine(model_files, dirs, device="cuda", dtype="bfloat16", max_loras=3,
                         enforce_eager=True, max_num_batched_tokens=128,
                         quantization=quantization).runner
    lora_rows = runner.lora.batch.lora_rows
    kernels = step_logits(runner, requests)
    runner.lora.batch.lora_rows = None  # (the torch path)
    torch_path = step_logits(runner, requests)
    base = step_logits(runner, [(index, "") for index, _ in requests])
    runner.lora.batch.lora_rows = lora_rows
    rows = [len(PROMPTS[i]) for i, _ in requests]
    for (_, name), got, expected, plain in zip(requests, kernels.split(rows),
                                               torch_path.split(rows), base.split(rows)):
        if not name:
            assert torch.equal(got, expected)
            continue
        delta, expected_delta = got - plain, expected - plain
        assert expected_delta.abs().max() > 0.1, "the adapter must change the logits"
        assert ((delta - expected_delta).norm() / expected_delta.norm()).item() < 0.05


def test_base_steps_with_lora_on_replay_the_graphs_without_it_bitwise(tiny_adapters):
    """Only base requests with LoRA on: no graph with the deltas replays, and every token and
    logprob is LoRA off's (bf16, the graphs as served)."""
    model_files, dirs = tiny_adapters
    requests = [(i, "") for i in range(len(PROMPTS))]
    on = lora_engine(model_files, dirs, device="cuda", dtype="bfloat16")
    decode, mixed = count_lora_replays(on.runner)
    with_lora = run(on, requests, logprobs=1)
    assert decode[0] == mixed[0] == 0
    off = lora_engine(model_files, dirs, device="cuda", dtype="bfloat16", enable_lora=False,
                      lora_modules="")
    assert run(off, requests, logprobs=1) == with_lora
