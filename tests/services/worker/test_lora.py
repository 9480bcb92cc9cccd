"""LoRA adapters on the worker (issue 50, step 1): random-weight PEFT adapters on SmolLM2's real
weights, saved by peft itself, give transformers + PEFT's logits and greedy text through
flotilla, mixed with other adapters and the base model in the same steps and with more
adapters than device slots; bad adapters are refused naming what is wrong; a base-only step
with LoRA enabled is bitwise the step without it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import msgspec
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.lora import load_adapter, tensor_name
from services.worker.lora_slots import NoLora
from services.worker.runner_build import build_runner
from services.worker.step_inputs import SequenceChunk, build_step_inputs, logits_layout
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import resolve_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS = {"all8": (8, 16, ALL_SEVEN, False),
            "sub16": (16, 8, ["q_proj", "v_proj", "down_proj"], True),
            "mlp8": (8, 32, ["gate_proj", "up_proj", "o_proj"], False)}
NUM_NEW_TOKENS = 12
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def model_files():
    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def hf_lora(model_files, tmp_path_factory):
    """(transformers + PEFT with every adapter loaded, {name: its directory})."""
    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(model_files.path, dtype=torch.float32).eval()
    dirs = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        peft_model = get_peft_model(base, LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
            init_lora_weights=False))
        dirs[name] = root / name
        peft_model.save_pretrained(dirs[name])
        base = peft_model.unload()  # (the base model again, without LoRA layers)
    names = list(ADAPTERS)
    model = PeftModel.from_pretrained(base, dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(dirs[name], adapter_name=name)
    return model.eval(), dirs


def hf_run(hf_model, name: str, fn):
    """``fn()`` with adapter ``name`` active ("": the base model, adapters off)."""
    with torch.inference_mode():
        if not name:
            with hf_model.disable_adapter():
                return fn()
        hf_model.set_adapter(name)
        return fn()


@pytest.fixture(scope="module")
def prompts(model_files) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_files.path)
    return [tokenizer(text)["input_ids"] for text in
            ("The history of the Roman Empire", "def fibonacci(n):", "Paris is the capital of")]


def lora_engine(model_files, dirs, **worker_knobs) -> Engine:
    modules = ",".join(f"{name}={path}" for name, path in dirs.items())
    worker = WorkerConfig(device="cpu", kv_cache_memory="24MiB", block_size=BLOCK_SIZE,
                          enable_lora=True, lora_modules=modules, max_loras=2, **worker_knobs)
    return Engine(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                  prefix_caching=False), worker, model_files)


@pytest.fixture(scope="module")
def engine(model_files, hf_lora):
    return lora_engine(model_files, hf_lora[1])


def flotilla_logits(runner, prompt: list[int], lora_name: str) -> torch.Tensor:
    """Every position's logits [len(prompt), vocab] of ``prompt`` in one step (blocks 0..)."""
    chunk = SequenceChunk(token_ids=list(prompt), start=0,
                          block_table=list(range(-(-len(prompt) // BLOCK_SIZE))), sample=True,
                          num_logprob_rows=len(prompt) - 1)
    layout = logits_layout([chunk])
    input_ids, positions, metadata = build_step_inputs([chunk], BLOCK_SIZE, torch.device("cpu"),
                                                       layout)
    runner.lora.begin([SimpleNamespace(lora_name=lora_name)], [chunk], [])  # (as a step)
    try:
        with torch.inference_mode():
            return runner.model(input_ids, positions, metadata)
    finally:
        runner.lora.end()


def test_logits_of_each_adapter_equal_transformers_peft(engine, hf_lora, prompts):
    hf_model, _ = hf_lora
    prompt = prompts[0]
    base = flotilla_logits(engine.runner, prompt, "")
    for name in ADAPTERS:
        expected = hf_run(hf_model, name,
                          lambda: hf_model(torch.tensor([prompt])).logits[0])  # [n, vocab]
        got = flotilla_logits(engine.runner, prompt, name)
        assert (got - base).abs().max() > 1e-2, f"{name} changes nothing"
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def greedy_references(hf_model, requests: list[tuple[int, str]], prompts) -> list[list[int]]:
    def generate(prompt):
        return lambda: hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                         max_new_tokens=NUM_NEW_TOKENS)[0, len(prompt):].tolist()
    return [hf_run(hf_model, name, generate(prompts[index])) for index, name in requests]


def run_engine(engine, requests: list[tuple[int, str]], prompts) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    completions, _ = engine.generate([prompts[index] for index, _ in requests],
                                     [greedy] * len(requests), [name for _, name in requests])
    return [c.output_token_ids for c in completions]


def test_a_batch_mixing_adapters_and_the_base_gives_each_its_reference(engine, hf_lora,
                                                                       prompts):
    hf_model, _ = hf_lora
    requests = [(0, "all8"), (0, "sub16"), (0, ""), (1, "sub16"), (2, "all8"), (1, "")]
    expected = greedy_references(hf_model, requests, prompts)
    assert len({tuple(e) for e in expected[:3]}) == 3, "adapters must change the text"
    assert run_engine(engine, requests, prompts) == expected


def test_overlapped_steps_and_host_memory_for_one_adapter_keep_the_references(
        model_files, hf_lora, prompts):
    """Steps queued before the one before is read back (CUDA's default, here on the CPU), and
    adapters read from disk again when host memory holds only two (--max-cpu-loras)."""
    hf_model, dirs = hf_lora
    engine = lora_engine(model_files, dirs, overlap_steps="on", max_cpu_loras=2)
    assert len(engine.runner.lora.host) == 2
    for requests in ([(1, "all8"), (2, ""), (0, "mlp8")], [(2, "sub16"), (0, "all8")]):
        assert run_engine(engine, requests, prompts) == \
            greedy_references(hf_model, requests, prompts)
    assert engine.runner.num_overlapped_steps > 0


def test_more_adapters_than_slots_evict_and_still_give_their_references(engine, hf_lora,
                                                                        prompts):
    hf_model, _ = hf_lora
    batches = [[(2, "mlp8"), (1, "all8")], [(0, "sub16"), (2, "")], [(1, "mlp8"), (0, "sub16")],
               [(2, "all8")]]
    for requests in batches:
        assert run_engine(engine, requests, prompts) == \
            greedy_references(hf_model, requests, prompts)
    assert set(engine.runner.lora.tenants) <= set(ADAPTERS)


def test_a_base_only_step_with_lora_enabled_is_bitwise_the_step_without(engine, model_files,
                                                                        prompts):
    plain = build_runner(WorkerConfig(device="cpu", kv_cache_memory="24MiB",
                                      block_size=BLOCK_SIZE), model_files)
    assert isinstance(plain.lora, NoLora)
    assert engine.runner.model.layers[0].self_attn.qkv_proj.lora is not None
    for prompt in prompts:
        assert torch.equal(flotilla_logits(engine.runner, prompt, ""),
                           flotilla_logits(plain, prompt, ""))


def test_an_unknown_or_unreadable_adapter_is_refused_alone_and_too_many_fail_the_step(
        engine, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    plan = StepPlan(step_id=1, new_requests=[
        NewRequestData("base", [1, 2, 3], greedy, [0]),
        NewRequestData("r", [1, 2, 3], greedy, [1], lora_name="nope"),
        NewRequestData("gone", [1, 2, 3], greedy, [2], lora_name="late",
                       lora_path=str(tmp_path / "removed"), lora_hash="h1")],
        scheduled=[ScheduledRequest("base", 3), ScheduledRequest("r", 3),
                   ScheduledRequest("gone", 3)])
    result = engine.runner.execute(plan)
    assert result.request_ids == ["base"] and len(result.sampled_token_ids) == 1
    assert result.refused_request_ids == ["r", "gone"]
    assert "unknown LoRA adapter 'nope'" in result.refusal_reasons[0]
    assert "LoRA adapter 'late' cannot be used on this replica" in result.refusal_reasons[1]
    engine.runner.reset()
    with pytest.raises(ValueError, match="a step uses 3 LoRA adapters, more than max_loras 2"):
        engine.runner.lora.set_step(list(ADAPTERS), [1, 1, 1])
    with pytest.raises(ValueError, match="lora_name 'x' but LoRA is not enabled"):
        NoLora().resolve("r", "x")


def copy_adapter(source, target, settings=None, drop: str | None = None):
    shutil.copytree(source, target)
    if settings:
        config = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps(config | settings))
    if drop:
        tensors = load_file(target / "adapter_model.safetensors")
        del tensors[drop]
        save_file(tensors, target / "adapter_model.safetensors")
    return target


def test_bad_adapters_are_refused_naming_what_is_wrong(engine, hf_lora, tmp_path):
    _, dirs = hf_lora
    config = engine.runner.model.config
    with pytest.raises(ValueError, match="rank r=16 is above max_lora_rank 8"):
        load_adapter("sub16", dirs["sub16"], config, max_rank=8)
    lm_head = copy_adapter(dirs["all8"], tmp_path / "head", {"target_modules": ["lm_head"]})
    with pytest.raises(ValueError, match="target module 'lm_head' is not supported"):
        load_adapter("head", lm_head, config, max_rank=16)
    other_base = dataclasses.replace(config, intermediate_size=2048)
    with pytest.raises(ValueError, match=r"tensor base_model.model.model.layers.0.mlp.gate_proj"
                                         r".lora_B.weight has shape \[1536, 8\]"):
        load_adapter("all8", dirs["all8"], other_base, max_rank=16)
    missing = tensor_name(3, "v_proj", "lora_A")
    holey = copy_adapter(dirs["all8"], tmp_path / "holey", drop=missing)
    with pytest.raises(ValueError, match=f"tensor {missing} is missing"):
        load_adapter("holey", holey, config, max_rank=16)
    dora = copy_adapter(dirs["all8"], tmp_path / "dora", {"use_dora": True})
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        load_adapter("dora", dora, config, max_rank=16)


def test_lora_knobs_are_checked_once():
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        WorkerConfig(lora_modules="a=/x")
    with pytest.raises(ValueError, match="entry 'a' is not name=path"):
        WorkerConfig(enable_lora=True, lora_modules="a")
    with pytest.raises(ValueError, match="names 'a' twice"):
        WorkerConfig(enable_lora=True, lora_modules="a=/x,a=/y")
    assert WorkerConfig(enable_lora=True, lora_modules="a=/x, b=/y").lora_module_list == [
        ("a", "/x"), ("b", "/y")]


def test_a_plan_from_before_lora_decodes_to_the_base_model():
    """lora_name was added after NewRequestData's older fields, with a default: an older
    sender's message (without it) still decodes, to the base model."""
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    old = msgspec.msgpack.encode(["r", [1, 2], greedy, [0], 0, 0])
    assert msgspec.msgpack.decode(old, type=NewRequestData).lora_name == ""
    new = NewRequestData("r", [1, 2], greedy, [0], lora_name="all8")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=NewRequestData) == new


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_two_ranks_over_gloo_give_each_adapter_its_reference(model_files, hf_lora, prompts):
    """Adapters split over two ranks as their base projections are (SmolLM2's 3 KV heads as
    2 + 1: uneven parts), more adapters than the two slots: the references still."""
    hf_model, dirs = hf_lora
    engine = lora_engine(model_files, dirs, tensor_parallel_size=2)
    try:
        for requests in ([(0, "all8"), (1, "sub16"), (2, "")], [(2, "mlp8"), (0, "sub16")]):
            assert run_engine(engine, requests, prompts) == \
                greedy_references(hf_model, requests, prompts)
    finally:
        engine.close()


def test_a_retired_adapter_is_forgotten_its_host_copy_and_slot_freed(engine, hf_lora):
    _, dirs = hf_lora
    runner, greedy = engine.runner, SamplingParams(temperature=0.0, max_tokens=2)
    lora = runner.lora
    plan = StepPlan(step_id=1, new_requests=[NewRequestData(
        "r", [1, 2, 3], greedy, [0], lora_name="all8", lora_path=str(dirs["all8"]),
        lora_hash="v2")], scheduled=[ScheduledRequest("r", 3)])
    assert runner.execute(plan).request_ids == ["r"]
    assert "all8#v2" in lora.paths and "all8#v2" in lora.host and "all8#v2" in lora.tenants
    startup_hash = lora.hashes["all8"]
    runner.execute(StepPlan(step_id=2, new_requests=[], scheduled=[],
                            finished_request_ids=["r"], forgotten_loras=["all8:v2", "x:y"]))
    assert "all8#v2" not in lora.paths and "all8#v2" not in lora.host
    assert "all8#v2" not in lora.tenants and "all8" in lora.paths  # the other version stays
    runner.execute(StepPlan(step_id=3, new_requests=[], scheduled=[],
                            forgotten_loras=[f"all8:{startup_hash}"]))
    assert "all8" not in lora.paths and "all8" not in lora.host
    runner.reset()
    lora.register("all8", str(dirs["all8"]))  # (as the module's other tests expect it)
