"""Qwen2.5-VL through the whole stack: ``flotilla serve --model DIR`` on a tiny random
Qwen2.5-VL checkpoint saved by transformers (qwen2_5_vl_checkpoint.py) gives transformers'
greedy text on the same files and images (M-RoPE positions, the windowed tower), for one
image, two images in a message, and a multi-turn chat repeating an image (its second encode
a cache hit in /metrics, the first turn's blocks prefix-cache hits)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from services.tokenizer.qwen_images import QwenImagePrompts
from tests.integration.conftest import wait_for
from tests.integration.model_dirs import start_stack_on
from tests.integration.test_vision_serve import metric, parts
from tests.services.worker.qwen2_5_vl_checkpoint import shared_qwen2_5_vl_checkpoint
from tests.services.worker.test_idefics3 import make_image

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NUM_NEW_TOKENS = 8


@functools.cache
def hf_model(model_dir):
    """transformers' tokenizer, processor (its image and text side) and model, fp32."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return (tokenizer, QwenImagePrompts(model_dir, tokenizer),
            Qwen2_5_VLForConditionalGeneration.from_pretrained(
                str(model_dir), dtype=torch.float32).eval())


def hf_texts(model_dir, conversations) -> list[str]:
    """transformers' greedy text for each (messages, images)."""
    tokenizer, prompts, model = hf_model(model_dir)
    texts = []
    for messages, images in conversations:
        hf_messages = [{"role": m["role"], "content": m["content"] if isinstance(
            m["content"], str) else [{"type": "image"} if p["type"] == "image_url" else p
                                     for p in m["content"]]} for m in messages]
        text = tokenizer.apply_chat_template(hf_messages, add_generation_prompt=True,
                                             tokenize=False)
        inputs = dict(prompts.processor(text=[text], images=images, add_special_tokens=False,
                                        return_tensors="pt"))
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == prompts.image_token_id).int()
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=NUM_NEW_TOKENS)
        texts.append(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                      skip_special_tokens=True))
    return texts


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-vl")
    model_dir = shared_qwen2_5_vl_checkpoint(tmp_path_factory)
    stack = start_stack_on(model_dir, root / "logs", service_args={
        "worker": ["--kv-cache-memory", "16MiB", "--encoder-cache-size", "8"]})
    try:
        yield stack, model_dir
    finally:
        stack.stop()


def served_chat(stack, messages) -> str:
    reply = httpx.post(stack.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "qwen2.5-vl-tiny", "messages": messages, "temperature": 0,
        "max_tokens": NUM_NEW_TOKENS})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_served_qwen2_5_vl_gives_transformers_greedy_text(served):
    stack, model_dir = served
    models = httpx.get(stack.base_url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["input_modalities"] == ["text", "image"]
    a, b = make_image(300, 200, seed=1), make_image(130, 250, seed=2)
    first_turn = [{"role": "user", "content": parts(a, "Describe it.")}]
    conversations = [
        ([{"role": "user", "content": parts("What is in this image?", a)}], [a]),
        ([{"role": "user", "content": parts("Compare", a, "with", b, "in one sentence.")}],
         [a, b]),
    ]
    expected = hf_texts(model_dir, conversations + [(first_turn, [a])])
    assert len(set(expected)) == len(expected)  # the images change the answers
    with ThreadPoolExecutor(2) as pool:  # one image and two images, at once
        replies = list(pool.map(lambda c: served_chat(stack, c[0]), conversations))
    assert replies == expected[:2]
    assert wait_for(lambda: metric(stack, "flotilla_encoder_images") == 2)
    # a multi-turn chat repeating image a: its encodes are cache hits
    assert served_chat(stack, first_turn) == expected[2]
    second_turn = first_turn + [
        {"role": "assistant", "content": expected[2]},
        {"role": "user", "content": parts("Here it is again:", a, "What colour is it?")}]
    hits_before = metric(stack, "flotilla_encoder_cache_hits")
    prefix_before = metric(stack, "flotilla_prefix_cache_hits")
    (expected_second,) = hf_texts(model_dir, [(second_turn, [a, a])])
    assert served_chat(stack, second_turn) == expected_second
    # the first turn's blocks, its image's included, come from the prefix cache (positions
    # of the tokens after them computed from the whole prompt); the second image's encode
    # is a cache hit
    assert wait_for(lambda: metric(stack, "flotilla_prefix_cache_hits") >= prefix_before + 32)
    assert wait_for(lambda: metric(stack, "flotilla_encoder_cache_hits") >= hits_before + 1)
    assert metric(stack, "flotilla_encoder_images") == 2  # a was never encoded again
