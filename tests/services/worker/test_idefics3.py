"""Idefics3 (SmolVLM) in the worker, in process: an Idefics3 checkpoint of SmolLM2's real
weights and a small random SigLIP tower (idefics3_checkpoint.py), preprocessed by the
tokenizer tier's code (transformers' processor), gives transformers' Idefics3 image features,
logprobs and greedy text, for one image, two images in a message, a chat repeating an image
(its second encode a cache hit), and prompts chunked through an image's placeholders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Idefics3ForConditionalGeneration

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.tokenizer.images import ImagePrompts
from services.worker.config import WorkerConfig
from services.worker.image_inputs import image_pixels, load_image_encoder
from shared.messages import SamplingParams
from shared.sections.media import EncoderCache
from shared.models import ModelFiles
from tests.services.worker.idefics3_checkpoint import shared_idefics3_checkpoint

NUM_NEW_TOKENS = 8


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth seeded picture (gradients and a disc), not noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, 3)
    pixels = np.stack([(base[c] + 120 * np.sin((x * (c + 1) + y) / (17 + 9 * c))) % 255
                       for c in range(3)], axis=-1)
    cx, cy = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height
    pixels[(x - cx) ** 2 + (y - cy) ** 2 < (min(width, height) / 4) ** 2] = rng.uniform(0, 255, 3)
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = shared_idefics3_checkpoint(tmp_path_factory)
    processor = AutoProcessor.from_pretrained(str(path))
    hf = Idefics3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    return ModelFiles(name="smolvlm-tiny", path=path), processor, hf


def chat(*turns) -> list[dict]:
    """(role, [parts]) turns, a part an Image or text -> chat messages."""
    return [{"role": role, "content": [{"type": "image"} if isinstance(part, Image.Image)
                                       else {"type": "text", "text": part} for part in parts]}
            for role, parts in turns]


def hf_greedy(processor, hf, text: str, images: list[Image.Image]):
    """transformers' greedy tokens and each one's logprob (fp32)."""
    inputs = processor(text=text, images=[images], add_special_tokens=False, return_tensors="pt")
    with torch.inference_mode():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def conversations():
    a, b = make_image(300, 200, seed=1), make_image(160, 240, seed=2)
    return {
        "one image": (chat(("user", [a, "What is in this image?"])), [a]),
        "two images": (chat(("user", ["Compare", a, "with", b, "in one sentence."])), [a, b]),
        "repeated image": (chat(("user", [a, "Describe it."]),
                                ("assistant", ["It is a colourful picture."]),
                                ("user", ["Here it is again:", a, "What colour is it?"])),
                           [a, a]),
    }


def test_tower_gives_transformers_image_features(vlm):
    model_files, processor, hf = vlm
    image = make_image(300, 200, seed=1)
    prompts = ImagePrompts(model_files.path, processor.tokenizer)
    _, (image_input,) = prompts.encode("<image>", [image])
    assert image_input.pixel_shape == [5, 3, 512, 512]  # 2 x 2 tiles and the global view
    inputs = processor(text="<image>", images=[[image]], return_tensors="pt")
    assert image_input.pixel_dtype == "uint8"  # codes and a table, 1/4 of float32's bytes
    assert len(image_input.pixels) == 5 * 3 * 512 * 512
    assert torch.equal(image_pixels(image_input), inputs["pixel_values"][0])  # exactly
    encoder = load_image_encoder(model_files, torch.device("cpu"), torch.float32,
                                 EncoderCache(encoder_cache_size=4))
    encoder.warm_up()  # blank tiles, one padded; neither counted nor cached
    assert encoder.num_encoded == 0 and len(encoder.cache) == 0
    pixels, mask = encoder._tensors(image_input)
    with torch.inference_mode():
        ours = encoder.tower(pixels, mask)
        theirs = hf.model.get_image_features(inputs["pixel_values"],
                                             inputs["pixel_attention_mask"]).pooler_output[0]
    assert ours.shape == theirs.shape == (5 * 64, 576)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def cases(vlm):
    """Each conversation's token ids and images (the tokenizer tier's code) and
    transformers' greedy tokens."""
    model_files, processor, hf = vlm
    prompts = ImagePrompts(model_files.path, processor.tokenizer)
    token_ids, images, expected = [], [], []
    for messages, pictures in conversations().values():
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        ids, image_inputs = prompts.encode(text, pictures)
        hf_ids, hf_tokens, hf_logprobs = hf_greedy(processor, hf, text, pictures)
        assert ids == hf_ids  # placeholders expanded as transformers' processor does
        token_ids.append(ids)
        images.append(image_inputs)
        expected.append((hf_tokens, hf_logprobs))
    return token_ids, images, expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_engine_greedy_equals_transformers_idefics3(vlm, cases, device, batched_tokens=96):
    """All three conversations at once, in 96-token steps: every image's placeholders are
    split over several chunks (each encode happens once: the cache serves the rest; the
    stack's test, tests/integration/test_vision_serve.py, takes whole prompts a step). On
    CUDA (fp32): the GPU path's kernels and decode graphs against transformers on the CPU."""
    model_files, processor, _ = vlm
    token_ids, images, expected = cases
    engine = Engine(SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=4),
                    WorkerConfig(device=device, dtype="float32", kv_cache_memory="64MiB"),
                    model_files)
    completions, _ = engine.generate(token_ids, [SamplingParams(
        max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=0)] * len(token_ids),
        images=images)
    assert [c.output_token_ids for c in completions] == [tokens for tokens, _ in expected]
    for completion, (_, hf_logprobs) in zip(completions, expected):  # fp32 logits close
        np.testing.assert_allclose(completion.logprobs, hf_logprobs, atol=2e-3)
    texts = [processor.tokenizer.decode(c.output_token_ids) for c in completions]
    assert all(texts) and len(set(texts)) == len(texts)  # the images change the answers
    encoder = engine.runner.images
    # two distinct images; the repeated one and the chunks after the first find the cache
    assert encoder.num_encoded == 2
    assert encoder.num_hits >= 3


def test_text_only_model_refuses_images(vlm, tmp_path):
    from services.worker.image_inputs import NoImages

    with pytest.raises(ValueError, match="text-only"):
        NoImages().add("r1", [object()])


def test_preempted_image_requests_recompute_to_the_same_text(vlm, cases):
    """A cache too small for the three conversations at once: requests are preempted and
    resent with the images their recompute needs (the encoder cache serves them)."""
    model_files, _, _ = vlm
    token_ids, images, expected = cases
    engine = Engine(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4,
                                    admission_reserve=False),  # (so requests are preempted)
                    WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="40MiB"),
                    model_files)
    completions, stats = engine.generate(token_ids, [SamplingParams(
        max_tokens=NUM_NEW_TOKENS, temperature=0.0)] * len(token_ids), images=images)
    assert [c.output_token_ids for c in completions] == [tokens for tokens, _ in expected]
    assert stats.num_preemptions > 0
    assert engine.runner.images.num_encoded == 2


def test_smolvlm_configs_read_as_a_llama_and_a_tower():
    """SmolVLM-256M-Instruct's config.json shape: its text_config names VLlama3ForCausalLM."""
    from services.worker.model_config import ModelConfig
    from services.worker.vision import VisionSpec

    config = {"architectures": ["Idefics3ForConditionalGeneration"], "image_token_id": 49190,
              "scale_factor": 4, "vision_config": {
                  "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "image_size": 512, "patch_size": 16},
              "text_config": {"architectures": ["VLlama3ForCausalLM"], "model_type": "llama",
                              "vocab_size": 49280, "hidden_size": 576,
                              "intermediate_size": 1536, "num_hidden_layers": 30,
                              "num_attention_heads": 9, "num_key_value_heads": 3,
                              "rope_theta": 100000.0, "max_position_embeddings": 8192}}
    text = ModelConfig.from_dict(config)
    assert (text.family, text.num_layers, text.vocab_size) == ("llama", 30, 49280)
    spec = VisionSpec.from_dict(config)
    assert (spec.tokens_per_tile, spec.text_hidden_size, spec.patches_per_side) == (64, 576, 32)
    assert VisionSpec.from_dict(config["text_config"]) is None  # a text-only config.json
