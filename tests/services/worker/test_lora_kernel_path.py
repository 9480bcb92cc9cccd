"""LoRA through kernels/lora.py's shrink and expand in the model (issue 50, deliverable 2),
on the CPU under Triton's interpreter: the greedy text of requests of several adapters and of
the base model in the same steps (chunked prompts beside decodes) equals transformers +
PEFT's on a tiny Llama. The CPU runs the kernel path by handing the model's projections a row
buffer as the CUDA worker does (``LoraBatch.lora_rows``). On CUDA, inside the graphs:
test_lora_gpu.py."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import kernels.lora_delta
from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import ModelFiles
from tests.cli.test_engine import TINY, hf_greedy

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS = {"all8": (8, 16, ALL_SEVEN, False),
            "sub16": (16, 8, ["q_proj", "v_proj", "down_proj"], True),
            "mlp4": (4, 32, ["gate_proj", "up_proj", "o_proj"], False)}
NUM_NEW_TOKENS = 8
# (prompt, adapter): every adapter and the base model, in the same steps
REQUESTS = [(0, "all8"), (1, ""), (2, "sub16"), (0, "mlp4"), (3, "all8"), (0, ""),
            (1, "sub16"), (2, "all8")]
PROMPTS = [[1 + (11 * i + 3 * k) % 250 for k in range(5 + 4 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    """(base ModelFiles, {name: directory}, greedy references of REQUESTS)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    root = tmp_path_factory.mktemp("lora-kernels")
    base.save_pretrained(root / "base", safe_serialization=True)
    dirs = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + seed)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                use_rslora=rslora, init_lora_weights=False))
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        base = model.unload()
    expected = {}
    for name in ["", *ADAPTERS]:
        with_adapter = base if not name else PeftModel.from_pretrained(base, dirs[name]).eval()
        for index in {i for i, n in REQUESTS if n == name}:
            expected[index, name] = hf_greedy(with_adapter, PROMPTS[index], NUM_NEW_TOKENS)
        base = with_adapter if not name else with_adapter.unload()
    return ModelFiles(name="tiny-llama", path=root / "base"), dirs, expected


def lora_engine(model_files, dirs, **worker_knobs) -> Engine:
    worker = WorkerConfig(kv_cache_memory="8MiB", block_size=8, enable_lora=True,
                          lora_modules=",".join(f"{n}={p}" for n, p in dirs.items()),
                          max_loras=3, max_num_batched_tokens=64, **worker_knobs)
    return Engine(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24), worker,
                  model_files)


def run(engine) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    completions, _ = engine.generate([PROMPTS[i] for i, _ in REQUESTS], [greedy] * len(REQUESTS),
                                     [name for _, name in REQUESTS])
    return [c.output_token_ids for c in completions]


def test_the_kernels_in_the_model_give_the_references_on_the_cpu(tiny_adapters, monkeypatch):
    """Chunked prompts beside decodes (a 24-token budget), three adapters and the base model
    in one step, through the kernels under the interpreter."""
    model_files, dirs, expected = tiny_adapters
    references = [expected[request] for request in REQUESTS]
    assert len({tuple(references[i]) for i in (0, 3, 5)}) == 3, "adapters must change the text"
    engine = lora_engine(model_files, dirs, device="cpu", dtype="float32")
    lora = engine.runner.lora
    assert lora.batch.lora_rows is None  # (the CPU's torch path)
    lora.batch.lora_rows = torch.zeros(1 + 2 * lora.max_num_tokens, dtype=torch.int32)
    launches = []
    shrink = kernels.lora_delta.lora_shrink
    monkeypatch.setattr(kernels.lora_delta, "lora_shrink",
                        lambda x, a, rows, config=None: launches.append(len(x))
                        or shrink(x, a, rows, config))
    assert run(engine) == references
    assert launches  # (the kernels ran)
