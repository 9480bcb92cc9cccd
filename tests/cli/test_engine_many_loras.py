"""Many LoRA adapters through few slots (issue 50's acceptance, on the CPU with a tiny model):
64 adapters registered, 8 device slots, one request per adapter submitted at once; the
scheduler keeps the running requests within 8 adapters, the worker moves adapters in and out
of its slots, and every greedy output equals transformers + PEFT with its adapter."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import ModelFiles
from tests.cli.test_engine import TINY, hf_greedy

NUM_ADAPTERS, NUM_SLOTS, NUM_NEW_TOKENS = 64, 8, 6
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory):
    """(base ModelFiles, {name: directory}, {name: greedy reference}, prompts by name)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    root = tmp_path_factory.mktemp("many-loras")
    base.save_pretrained(root / "base", safe_serialization=True)
    dirs, expected, prompts = {}, {}, {}
    for index in range(NUM_ADAPTERS):
        name = f"a{index:02d}"
        torch.manual_seed(100 + index)
        model = get_peft_model(base, LoraConfig(r=4 + 4 * (index % 2), lora_alpha=16,
                                                target_modules=TARGETS, init_lora_weights=False))
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        base = model.unload()
        # (no token 0: the reference's generate() takes it for padding)
        prompts[name] = [1 + (7 * index + k) % 255 for k in range(5 + index % 7)]
        with_adapter = PeftModel.from_pretrained(base, dirs[name]).eval()
        expected[name] = hf_greedy(with_adapter, prompts[name], NUM_NEW_TOKENS)
        base = with_adapter.unload()
    return ModelFiles(name="tiny-llama", path=root / "base"), dirs, expected, prompts


def test_64_adapters_through_8_slots_each_give_their_reference(many_adapters):
    model_files, dirs, expected, prompts = many_adapters
    assert len({tuple(tokens) for tokens in expected.values()}) > NUM_ADAPTERS // 2
    worker = WorkerConfig(device="cpu", kv_cache_memory="8MiB", block_size=8, enable_lora=True,
                          lora_modules=",".join(f"{n}={p}" for n, p in dirs.items()),
                          max_loras=NUM_SLOTS, max_cpu_loras=16)
    engine = Engine(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=128), worker,
                    model_files)
    names = list(dirs)
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    completions, _ = engine.generate([prompts[n] for n in names], [greedy] * len(names), names)
    assert {n: c.output_token_ids for n, c in zip(names, completions)} == expected
    lora = engine.runner.lora
    assert len(lora.tenants) == NUM_SLOTS and len(lora.host) == 16

