"""LoRA adapters through the whole stack (issue 50): ``flotilla serve --enable-lora
--lora-modules ...`` on SmolLM2's real weights with random-weight PEFT adapters (written by
peft itself). Requests name an adapter in ``model``; with requests of every adapter and of
the base model in flight at once, each greedy text equals transformers + PEFT with that
adapter (or the base model's); the prefix cache never serves one adapter's blocks to
another; an adapter loaded at run time serves the same, and after its unload its name is a
404 while the request in flight with it finishes; bad adapters get 400s naming the reason.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli.stack import Stack, StackOptions, free_port
from shared.models import resolve_model

pytestmark = pytest.mark.integration
NUM_NEW_TOKENS = 12
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA); "late" is loaded at run time
ADAPTERS = {"all8": (8, 16, ALL_SEVEN, False), "sub16": (16, 8, ["q_proj", "v_proj", "down_proj"],
                                                        True),
            "late": (8, 32, ALL_SEVEN, False)}
# the first is over 16 tokens (a full block) and shared by every request: the prefix cache
# would hand one adapter's blocks to the next if its key lacked the adapter
PROMPTS = ["The history of the Roman Empire begins with a small town on the banks of the Tiber, "
           "where", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """({name: PEFT directory}, {(adapter, prompt index): greedy text}, tokenizer); adapter
    "" is the base model."""
    base_dir = resolve_model("smollm2").path
    root = tmp_path_factory.mktemp("adapters")
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    dirs = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                use_rslora=rslora, init_lora_weights=False))
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        base = model.unload()
    peft_model = PeftModel.from_pretrained(base, dirs["all8"], adapter_name="all8")
    for name in ("sub16", "late"):
        peft_model.load_adapter(dirs[name], adapter_name=name)
    expected = {}
    for name in ("", *ADAPTERS):
        for index, text in enumerate(PROMPTS):
            expected[name, index] = _greedy(peft_model.eval(), tokenizer, name, text)
    assert len({expected[name, 0] for name in ("", *ADAPTERS)}) == 4, "adapters change the text"
    return dirs, expected, tokenizer


def _greedy(peft_model, tokenizer, name: str, text: str) -> str:
    ids = tokenizer(text)["input_ids"]
    with torch.inference_mode():
        def generate():
            return peft_model.generate(torch.tensor([ids]), do_sample=False,
                                       max_new_tokens=NUM_NEW_TOKENS)[0, len(ids):]
        if not name:
            with peft_model.disable_adapter():
                out = generate()
        else:
            peft_model.set_adapter(name)
            out = generate()
    return tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def stack(adapters, tmp_path_factory):
    dirs, _, _ = adapters
    lora = ["--enable-lora", "--lora-modules", f"all8={dirs['all8']},sub16={dirs['sub16']}",
            "--max-loras", "3"]
    stack = Stack(StackOptions(
        host="127.0.0.1", port=free_port(), log_dir=tmp_path_factory.mktemp("logs"),
        service_args={"worker": [*lora, "--kv-cache-memory", "64MiB"], "scheduler": lora}))
    stack.start(timeout_s=300)
    yield stack
    stack.stop()


def _client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)


async def _complete(client, model: str, index: int, max_tokens: int = NUM_NEW_TOKENS) -> str:
    response = await client.completions.create(model=model, prompt=PROMPTS[index],
                                               temperature=0, max_tokens=max_tokens)
    assert response.model == model
    return response.choices[0].text


def test_models_lists_the_adapters_with_their_parent(stack, adapters):
    dirs, _, _ = adapters
    cards = httpx.get(stack.base_url + "/v1/models").json()["data"]
    base = cards[0]["id"]
    assert [(c["id"], c.get("parent"), c.get("root")) for c in cards[1:]] == [
        ("all8", base, str(dirs["all8"])), ("sub16", base, str(dirs["sub16"]))]
    assert httpx.get(f"{stack.base_url}/v1/models/sub16").json()["parent"] == base


def test_adapters_and_the_base_in_flight_at_once_give_their_references(stack, adapters):
    _, expected, _ = adapters
    base = httpx.get(stack.base_url + "/v1/models").json()["data"][0]["id"]
    requests = [(name, index) for name in ("all8", "", "sub16") for index in range(2)] * 2

    async def all_at_once():
        client = _client(stack)
        return await asyncio.gather(*(_complete(client, name or base, index)
                                      for name, index in requests))

    assert asyncio.run(all_at_once()) == [expected[request] for request in requests]


def test_one_prompt_after_another_never_hits_another_adapters_blocks(stack, adapters):
    _, expected, _ = adapters
    base = httpx.get(stack.base_url + "/v1/models").json()["data"][0]["id"]

    async def one_after_another():
        client = _client(stack)
        return [await _complete(client, name or base, 0) for name in ("sub16", "", "all8", "")]

    assert asyncio.run(one_after_another()) == [expected[name, 0]
                                                for name in ("sub16", "", "all8", "")]
    metrics = httpx.get(stack.base_url + "/metrics").text
    assert 'flotilla_lora_requests_total{lora_name="sub16"}' in metrics
    assert "vllm:lora_requests_info{" in metrics


def test_unknown_adapter_is_a_404_in_openais_shape(stack):
    reply = httpx.post(stack.base_url + "/v1/completions",
                       json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "model_not_found"


def test_an_adapter_loaded_at_run_time_serves_then_unloads_while_in_flight(stack, adapters,
                                                                           tmp_path):
    dirs, expected, _ = adapters
    url = stack.base_url
    load = {"lora_name": "late", "lora_path": str(dirs["late"])}
    reply = httpx.post(url + "/v1/load_lora_adapter", json=load)
    assert reply.status_code == 200, reply.text
    assert httpx.post(url + "/v1/load_lora_adapter", json=load).status_code == 400  # twice
    assert httpx.post(url + "/v1/load_lora_adapter",
                      json=load | {"load_inplace": True}).status_code == 200

    async def serve_then_unload():
        client = _client(stack)
        first = await _complete(client, "late", 1)
        # a long request with it in flight when it is unloaded: it finishes all the same
        in_flight = asyncio.create_task(_complete(client, "late", 0, max_tokens=160))
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient() as http:
            unloaded = await http.post(url + "/v1/unload_lora_adapter",
                                       json={"lora_name": "late"})
        return first, unloaded, await in_flight

    first, unloaded, long_text = asyncio.run(serve_then_unload())
    assert first == expected["late", 1]
    assert unloaded.status_code == 200, unloaded.text
    assert long_text.startswith(expected["late", 0])
    gone = httpx.post(url + "/v1/completions", json={"model": "late", "prompt": "hi"})
    assert gone.status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter",
                      json={"lora_name": "late"}).status_code == 404


def test_bad_adapters_are_refused_on_load_naming_the_reason(stack, adapters, tmp_path):
    dirs, _, _ = adapters
    url = stack.base_url

    def refusal(path, name="bad") -> str:
        reply = httpx.post(url + "/v1/load_lora_adapter",
                           json={"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]["message"]

    big = shutil.copytree(dirs["all8"], tmp_path / "big")
    config = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps(config | {"r": 64}))
    assert "rank r=64 is above max_lora_rank 16" in refusal(big)
    assert "no such directory" in refusal(tmp_path / "missing")
    holey = shutil.copytree(dirs["all8"], tmp_path / "holey")
    (holey / "adapter_model.safetensors").write_bytes(b"not safetensors")
    assert "is not a safetensors file" in refusal(holey)
    assert "registered already" in refusal(dirs["all8"], name="all8")
    names = [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]]
    assert "bad" not in names and "all8" in names


def test_an_adapter_whose_files_vanish_fails_its_requests_alone(stack, adapters, tmp_path):
    """Loaded at run time (checked and hashed by the scheduler), its files removed before the
    worker first reads them: requests naming it end with a 500 giving the reason, while a
    base request in flight at the same time finishes with its reference text."""
    dirs, expected, _ = adapters
    base = httpx.get(stack.base_url + "/v1/models").json()["data"][0]["id"]
    doomed = shutil.copytree(dirs["late"], tmp_path / "doomed")
    reply = httpx.post(stack.base_url + "/v1/load_lora_adapter",
                       json={"lora_name": "doomed", "lora_path": str(doomed)})
    assert reply.status_code == 200, reply.text
    shutil.rmtree(doomed)

    async def both():
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            body = {"prompt": PROMPTS[1], "temperature": 0, "max_tokens": NUM_NEW_TOKENS}
            return await asyncio.gather(
                http.post("/v1/completions", json=body | {"model": base}),
                http.post("/v1/completions", json=body | {"model": "doomed"}))

    base_reply, doomed_reply = asyncio.run(both())
    assert base_reply.status_code == 200
    assert base_reply.json()["choices"][0]["text"] == expected["", 1]
    assert doomed_reply.status_code == 500, doomed_reply.text
    assert "LoRA adapter 'doomed' cannot be used on this replica" in \
        doomed_reply.json()["error"]["message"]
    assert httpx.post(stack.base_url + "/v1/unload_lora_adapter",
                      json={"lora_name": "doomed"}).status_code == 200


@pytest.mark.slow
def test_a_restarted_scheduler_of_a_fleet_of_one_gets_its_run_time_adapters_back(stack,
                                                                                  adapters):
    """The only replica's scheduler killed and restarted: it comes back with its
    --lora-modules only, and the gateway loads again what it had loaded at run time (there
    is no peer to learn it from), so the adapter serves its reference text again."""
    dirs, expected, _ = adapters
    reply = httpx.post(stack.base_url + "/v1/load_lora_adapter",
                       json={"lora_name": "again", "lora_path": str(dirs["late"])})
    assert reply.status_code == 200, reply.text
    stack.stop_service("scheduler", signal.SIGKILL)
    stack.start_service("scheduler")
    stack.wait_ready(120)

    def served() -> list[str]:
        return [card["id"] for card in httpx.get(stack.base_url + "/v1/models").json()["data"]]

    deadline = time.monotonic() + 60
    while "again" not in served() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {"all8", "sub16", "again"} <= set(served())
    body = {"model": "again", "prompt": PROMPTS[1], "temperature": 0,
            "max_tokens": NUM_NEW_TOKENS}
    answer = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected["late", 1]
