"""The scheduler's LoRA registry and the shared adapter checks (issue 50), pure: adapters
checked from their files against the worker's announced shapes, 404 for an unknown name,
a reload under one name is a new version (a new prefix-cache key), and admission keeps the
running requests within max_loras adapters."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.scheduler.config import SchedulerConfig
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.scheduler import Scheduler
from shared.errors import InvalidRequest, NotFound
from shared.lora_adapters import BaseShapes, inspect_adapter, tensor_name
from shared.messages import GenerateRequest, SamplingParams

BASE = BaseShapes(num_layers=2, part_shapes={"q_proj": [8, 8], "v_proj": [4, 8]}, max_rank=4)


def write_adapter(path, rank=2, targets=("q_proj", "v_proj"), scale=1.0, **settings):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 4, "target_modules": list(targets)}
        | settings))
    tensors = {}
    for layer in range(BASE.num_layers):
        for part in (t for t in targets if t != "lm_head"):  # (no tensor name for it)
            out_features, in_features = BASE.part_shapes.get(part, [8, 8])
            tensors[tensor_name(layer, part, "lora_A")] = np.full((rank, in_features), scale,
                                                                  np.float32)
            tensors[tensor_name(layer, part, "lora_B")] = np.zeros((out_features, rank),
                                                                   np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_an_adapter_is_checked_from_its_files_against_the_base(tmp_path):
    ref = inspect_adapter("a", write_adapter(tmp_path / "a"), BASE)
    assert (ref.name, ref.rank, len(ref.content_hash)) == ("a", 2, 16)
    cases = [(dict(rank=8), "rank r=8 is above max_lora_rank 4"),
             (dict(targets=("q_proj", "gate_proj")), "MLP targets on a Mixture-of-Experts"),
             (dict(targets=("lm_head",)), "target module 'lm_head' is not supported"),
             (dict(use_dora=True), "use_dora=True is not supported")]
    for index, (settings, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            inspect_adapter("b", write_adapter(tmp_path / f"b{index}", **settings), BASE)
    other_base = BaseShapes(num_layers=2, part_shapes={"q_proj": [16, 8], "v_proj": [4, 8]},
                            max_rank=4)
    with pytest.raises(ValueError, match=r"q_proj.lora_B.weight has shape \[8, 2\], the base "
                                         r"model's q_proj needs \[16, 2\]"):
        inspect_adapter("a", tmp_path / "a", other_base)


def test_the_registry_names_what_is_wrong_and_versions_reloads(tmp_path):
    path = write_adapter(tmp_path / "a")
    registry = LoraRegistry(True, 2, [("a", str(path))])
    assert registry.resolve("") is None and registry.resolve("a").path == str(path)
    with pytest.raises(NotFound, match="The model `b` does not exist"):
        registry.resolve("b")
    with pytest.raises(InvalidRequest, match="registered already"):
        registry.check_load("a", str(path), False, BASE)
    with pytest.raises(InvalidRequest, match="the worker does not compute LoRA"):
        registry.check_load("c", str(path), False, None)
    with pytest.raises(InvalidRequest, match="LoRA is not enabled"):
        LoraRegistry().check_load("c", str(path), False, BASE)
    old_key = registry.resolve("a").cache_key
    write_adapter(path, scale=2.0)  # new weights under the same name
    registry.add(registry.check_load("a", str(path), True, BASE))
    assert registry.resolve("a").cache_key != old_key
    registry.remove("a")
    with pytest.raises(NotFound):
        registry.remove("a")


def test_admission_keeps_running_requests_within_max_loras(tmp_path):
    modules = [(name, str(write_adapter(tmp_path / name))) for name in ("a", "b", "c")]
    core = Scheduler(SchedulerConfig(max_num_seqs=8), num_blocks=64, block_size=4,
                     max_model_len=128, eos_token_ids=[], model_name="m",
                     loras=LoraRegistry(True, 2, modules))
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    for index, name in enumerate(["a", "b", "c", "", "a"]):
        core.add_request(GenerateRequest(request_id=f"r{index}", prompt_token_ids=[1, 2, 3],
                                         sampling=sampling, output_subject="", lora_name=name))
    plan = core.schedule()
    assert {new.request_id: new.lora_name for new in plan.new_requests} == {
        "r0": "a", "r1": "b", "r3": "", "r4": "a"}  # c waits: a and b fill both slots
    new = plan.new_requests[0]
    assert (new.lora_path, new.lora_hash) == (modules[0][1], core.loras.resolve("a").content_hash)
    blocks = {req.request_id: req.extra_keys for req in core.running}
    assert blocks["r0"] == blocks["r4"] != blocks["r1"] != blocks["r3"] == ("model:m",)
    with pytest.raises(NotFound):
        core.add_request(GenerateRequest(request_id="r9", prompt_token_ids=[1], sampling=sampling,
                                         output_subject="", lora_name="zzz"))


def test_unloaded_and_replaced_versions_reach_a_plan_once_no_request_uses_them(tmp_path):
    path = write_adapter(tmp_path / "a")
    core = Scheduler(SchedulerConfig(max_num_seqs=8), num_blocks=64, block_size=4,
                     max_model_len=128, eos_token_ids=[], model_name="m",
                     loras=LoraRegistry(True, 2, [("a", str(path))]))
    first = core.loras.resolve("a").cache_key
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    core.add_request(GenerateRequest(request_id="r0", prompt_token_ids=[1, 2, 3],
                                     sampling=sampling, output_subject="", lora_name="a"))
    assert core.schedule().forgotten_loras == []
    write_adapter(path, scale=2.0)  # replaced in place while r0 runs with the first version
    core.loras.add(core.loras.check_load("a", str(path), True, BASE))
    second = core.loras.resolve("a").cache_key
    core.add_request(GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                                     sampling=sampling, output_subject=""))
    assert core.schedule().forgotten_loras == []  # r0 still uses the first version
    core.abort(["r0"])
    assert core.schedule().forgotten_loras == [first]
    assert core.schedule().forgotten_loras == []  # given once
    core.loras.remove("a")
    core.loras.add(core.loras.check_load("a", str(path), False, BASE))  # the same files again
    assert core.loras.resolve("a").cache_key == second
    assert core.schedule().forgotten_loras == [] and not core.loras.retired  # kept: in use
