"""A vision-language model through the whole stack: ``flotilla serve --model DIR`` on an
Idefics3 checkpoint of SmolLM2's real weights and a small random SigLIP tower
(idefics3_checkpoint.py) gives transformers' Idefics3 greedy text on the same files and
images, for one image, two images in a message, and a multi-turn chat repeating an image
(its second encode a cache hit in /metrics); bad images get 400s naming the cause, before
anything is scheduled, while a good request in flight runs undisturbed."""

from __future__ import annotations

import base64
import functools
import io
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.integration.conftest import wait_for
from tests.integration.model_dirs import start_stack_on
from tests.services.worker.idefics3_checkpoint import shared_idefics3_checkpoint
from tests.services.worker.test_idefics3 import make_image

pytestmark = pytest.mark.integration
NUM_NEW_TOKENS = 8
MAX_IMAGE_BYTES = 200_000
MAX_IMAGE_PIXELS = 1_000_000


def data_url(image: Image.Image, image_format: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    mime = "image/" + image_format.lower()
    return f"data:{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def parts(*items) -> list[dict]:
    """Text and images (PIL, or a URL string starting with a scheme) as content parts."""
    out = []
    for item in items:
        if isinstance(item, Image.Image):
            out.append({"type": "image_url", "image_url": {"url": data_url(item)}})
        elif re.match(r"^(data|file|https?):", item):
            out.append({"type": "image_url", "image_url": {"url": item}})
        else:
            out.append({"type": "text", "text": item})
    return out


@functools.cache
def hf_model(model_dir):
    """transformers' processor and Idefics3 model (fp32) on the directory, loaded once."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    return (AutoProcessor.from_pretrained(str(model_dir)),
            Idefics3ForConditionalGeneration.from_pretrained(str(model_dir),
                                                             dtype=torch.float32).eval())


def hf_texts(model_dir, conversations) -> list[str]:
    """transformers' Idefics3 greedy text for each (messages, images)."""
    processor, model = hf_model(model_dir)
    texts = []
    for messages, images in conversations:
        hf_messages = [{"role": m["role"], "content": m["content"] if isinstance(
            m["content"], str) else [{"type": "image"} if p["type"] == "image_url" else p
                                     for p in m["content"]]} for m in messages]
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
        inputs = processor(text=text, images=[images], add_special_tokens=False,
                           return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=NUM_NEW_TOKENS)
        texts.append(processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                                skip_special_tokens=True))
    return texts


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    model_dir = shared_idefics3_checkpoint(tmp_path_factory)
    media = root / "media"
    media.mkdir()
    make_image(300, 200, seed=1).save(media / "a.png")
    limits = ["--limit-mm-per-prompt", '{"image": 2}', "--max-image-bytes",
              str(MAX_IMAGE_BYTES), "--allowed-local-media-path", str(media),
              "--allowed-media-domains", "images.example.com"]
    stack = start_stack_on(model_dir, root / "logs", service_args={
        "gateway": limits, "tokenizer": ["--max-image-pixels", str(MAX_IMAGE_PIXELS)],
        "worker": ["--kv-cache-memory", "64MiB", "--encoder-cache-size", "8"]},
        tokenizers=2)  # (one queue group: the tests' encodes go to either)
    try:
        yield stack, model_dir, media, root / "logs"
    finally:
        stack.stop()


def chat(stack, messages, max_tokens=NUM_NEW_TOKENS) -> httpx.Response:
    return httpx.post(stack.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "smolvlm-tiny", "messages": messages, "temperature": 0,
        "max_tokens": max_tokens})


def metric(stack, name: str) -> float:
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "_total{", name + "{", name + " ")))


def test_served_idefics3_gives_transformers_greedy_text(served):
    stack, model_dir, _, _ = served
    a, b = make_image(300, 200, seed=1), make_image(160, 240, seed=2)
    first_turn = [{"role": "user", "content": parts(a, "Describe it.")}]
    conversations = [
        ([{"role": "user", "content": parts(a, "What is in this image?")}], [a]),
        ([{"role": "user", "content": parts("Compare", a, "with", b, "in one sentence.")}],
         [a, b]),
    ]
    expected = hf_texts(model_dir, conversations + [(first_turn, [a])])
    models = httpx.get(stack.base_url + "/v1/models", timeout=10).json()["data"]
    assert models[0]["input_modalities"] == ["text", "image"]
    with ThreadPoolExecutor(2) as pool:  # one image and two images, at once
        replies = list(pool.map(lambda c: chat(stack, c[0]), conversations))
    assert [r.status_code for r in replies] == [200, 200], [r.text for r in replies]
    assert [r.json()["choices"][0]["message"]["content"] for r in replies] == expected[:2]
    response = httpx.post(stack.base_url + "/v1/responses", timeout=120, json={  # the same
        "model": "smolvlm-tiny", "temperature": 0, "max_output_tokens": NUM_NEW_TOKENS,
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(a)},
            {"type": "input_text", "text": "What is in this image?"}]}]})
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == expected[0]
    assert wait_for(lambda: metric(stack, "flotilla_encoder_images") == 2)
    # a multi-turn chat repeating image a: both of its encodes are cache hits
    reply = chat(stack, first_turn)
    assert reply.json()["choices"][0]["message"]["content"] == expected[2]
    second_turn = first_turn + [
        {"role": "assistant", "content": expected[2]},
        {"role": "user", "content": parts("Here it is again:", a, "What colour is it?")}]
    hits_before = metric(stack, "flotilla_encoder_cache_hits")
    prefix_before = metric(stack, "flotilla_prefix_cache_hits")
    (expected_second,) = hf_texts(model_dir, [(second_turn, [a, a])])
    reply = chat(stack, second_turn)
    assert reply.json()["choices"][0]["message"]["content"] == expected_second
    # the first turn's blocks, its image's included, come from the prefix cache; the
    # second image's encode is a cache hit
    assert wait_for(lambda: metric(stack, "flotilla_prefix_cache_hits") >= prefix_before + 320)
    assert wait_for(lambda: metric(stack, "flotilla_encoder_cache_hits") >= hits_before + 1)
    assert metric(stack, "flotilla_encoder_images") == 2  # a was never encoded again
    assert metric(stack, "flotilla_encoder_seconds") > 0
    # every request with images waited on the tokenizer tier: 3 above, then the two turns
    assert metric(stack, "flotilla_image_preprocess_seconds_count") == 5
    assert metric(stack, "flotilla_image_preprocess_seconds_sum") > 0


def noise_png(width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


BAD_INPUTS = {
    "corrupt": (parts("data:image/png;base64," + base64.b64encode(
        b"\x89PNG\r\n\x1a\nnot really a png").decode(), "?"), "invalid_image"),
    "unsupported format": (parts(data_url(make_image(64, 64, seed=4), "TIFF"), "?"),
                           "unsupported_image_format"),
    "over the byte limit": (parts(noise_png(400, 400), "?"), "image_too_large"),
    "over the pixel limit": (parts(Image.new("RGB", (1200, 1000), "red"), "?"),
                             "image_too_large"),
    "too many images": (parts(*[make_image(64, 64, seed=s) for s in range(3)], "?"),
                        "too_many_images"),
    "a host outside the allow-list": (parts("https://evil.example.org/a.png", "?"),
                                      "image_url_not_allowed"),
    "a file outside the allowed path": (parts("file:///etc/hostname", "?"),
                                        "image_url_not_allowed"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_images_get_400_naming_the_cause(served, case):
    stack, _, _, _ = served
    content, code = BAD_INPUTS[case]
    reply = chat(stack, [{"role": "user", "content": content}])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["param"] == "messages", error


def test_bad_images_leave_a_request_in_flight_undisturbed(served):
    stack, _, media, _ = served
    good = [{"role": "user", "content": parts("file://" + str(media / "a.png"), "Hi?")}]
    alone = chat(stack, good)
    assert alone.status_code == 200, alone.text
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(chat, stack, good)
        bad = list(pool.map(lambda c: chat(stack, [{"role": "user", "content": c[0]}]),
                            BAD_INPUTS.values()))
        assert all(r.status_code == 400 for r in bad)
        assert running.result().json()["choices"][0]["message"]["content"] == \
            alone.json()["choices"][0]["message"]["content"]
