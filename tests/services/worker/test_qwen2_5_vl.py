"""Qwen2.5-VL in the worker, in process: a tiny random Qwen2.5-VL checkpoint saved by
transformers (qwen2_5_vl_checkpoint.py), preprocessed by the tokenizer tier's code, gives
transformers' pixel values, grids and placeholder counts, its tower's outputs, and its greedy
tokens and logprobs (M-RoPE positions) for one image, two images in a message and a chat
repeating an image, whole prompts a step and in chunks that split the images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.tokenizer.qwen_images import QwenImagePrompts
from services.worker.config import WorkerConfig
from services.worker.qwen_images import load_any_image_encoder, mrope_positions, patch_pixels
from shared.messages import SamplingParams
from shared.sections.media import EncoderCache
from shared.models import ModelFiles
from tests.services.worker.qwen2_5_vl_checkpoint import shared_qwen2_5_vl_checkpoint
from tests.services.worker.test_idefics3 import chat, make_image

NUM_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = shared_qwen2_5_vl_checkpoint(tmp_path_factory)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    return ModelFiles(name="qwen2.5-vl-tiny", path=path), tokenizer, hf.eval()


def hf_inputs(prompts: QwenImagePrompts, text: str, images: list[Image.Image]) -> dict:
    """transformers' processor's tensors for the model (its image and text side)."""
    out = prompts.processor(text=[text], images=images or None, add_special_tokens=False,
                            return_tensors="pt")
    out["mm_token_type_ids"] = (out["input_ids"] == prompts.image_token_id).int()
    return dict(out)


def hf_greedy(hf, inputs: dict):
    with torch.inference_mode():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=NUM_NEW_TOKENS,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def conversations():
    a, b = make_image(300, 200, seed=1), make_image(130, 250, seed=2)
    return {
        "one image": (chat(("user", [a, "What is in this image?"])), [a]),
        "two images": (chat(("user", ["Compare", a, "with", b, "in one sentence."])), [a, b]),
        "repeated image": (chat(("user", [a, "Describe it."]),
                                ("assistant", ["It is a colourful picture."]),
                                ("user", ["Here it is again:", a, "What colour is it?"])),
                           [a, a]),
    }


def test_processor_matches_transformers(vlm):
    """Pixel values, grid and placeholder count as transformers' Qwen2VLImageProcessor."""
    from transformers import Qwen2VLImageProcessorPil

    model_files, tokenizer, _ = vlm
    prompts = QwenImagePrompts(model_files.path, tokenizer)
    reference = Qwen2VLImageProcessorPil.from_pretrained(str(model_files.path))
    for width, height in ((300, 200), (130, 250), (40, 30), (1000, 900)):
        image = make_image(width, height, seed=width)
        ids, (image_input,) = prompts.encode("a <|vision_start|><|image_pad|><|vision_end|>",
                                             [image])
        expected = reference(images=[image], return_tensors="pt")
        grid = expected["image_grid_thw"][0].tolist()
        assert image_input.grid_thw == grid
        assert image_input.length == grid[0] * grid[1] * grid[2] // 4
        assert ids.count(prompts.image_token_id) == image_input.length
        assert 4 <= image_input.length <= 48  # within min_pixels and max_pixels
        pixels = patch_pixels(image_input)
        assert torch.equal(pixels, expected["pixel_values"])  # exactly, as codes and a table


def test_tower_gives_transformers_image_features_alone_and_batched(vlm):
    model_files, tokenizer, hf = vlm
    prompts = QwenImagePrompts(model_files.path, tokenizer)
    encoder = load_any_image_encoder(model_files, torch.device("cpu"), torch.float32,
                                     EncoderCache(encoder_cache_size=4))
    inputs, expected = [], []
    for width, height in ((300, 200), (130, 250), (1000, 900)):  # 1 to 9 windows
        image = make_image(width, height, seed=width)
        _, (image_input,) = prompts.encode("<|image_pad|>", [image])
        pixels, grid = patch_pixels(image_input), tuple(image_input.grid_thw)
        with torch.inference_mode():
            ours = encoder.tower(pixels, grid)
            theirs = hf.model.visual(pixels, grid_thw=torch.tensor([grid])).pooler_output
        assert ours.shape == theirs.shape == (image_input.length, 64)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        inputs.append(image_input)
        expected.append(theirs)
    with torch.inference_mode():  # one tower call over the three (different windows, sizes)
        batched = encoder._run_tower(inputs)
    for ours, theirs in zip(batched, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_steps_images_encode_in_tower_calls_within_the_token_budget(vlm):
    model_files, tokenizer, _ = vlm
    prompts = QwenImagePrompts(model_files.path, tokenizer)
    encoder = load_any_image_encoder(model_files, torch.device("cpu"), torch.float32,
                                     EncoderCache(encoder_cache_size=0))
    inputs = [prompts.encode("<|image_pad|>", [make_image(200, 200, seed=s)])[1][0]
              for s in range(3)]
    encoder.max_batch_tokens = 2 * inputs[0].length
    encoder.warm_up()  # whole and cut-short windows; neither counted nor cached
    assert encoder.num_encoded == 0 and len(encoder.cache) == 0
    assert [len(group) for group in encoder._groups(inputs)] == [2, 1]
    outputs = encoder._outputs(inputs + inputs[:1])  # a repeat within the step encodes once
    assert encoder.num_encoded == 3 and set(outputs) == {image.hash for image in inputs}


def test_mrope_positions_match_transformers_get_rope_index(vlm):
    model_files, tokenizer, hf = vlm
    prompts = QwenImagePrompts(model_files.path, tokenizer)
    messages, images = conversations()["two images"]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids, image_inputs = prompts.encode(text, images)
    inputs = hf_inputs(prompts, text, images)
    expected, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                              image_grid_thw=inputs["image_grid_thw"])
    ours, our_delta = mrope_positions(len(ids), image_inputs, merge_size=2)
    np.testing.assert_array_equal(ours, expected[:, 0].numpy())
    assert our_delta == delta.item() < 0


@pytest.fixture(scope="module")
def cases(vlm):
    model_files, tokenizer, hf = vlm
    prompts = QwenImagePrompts(model_files.path, tokenizer)
    token_ids, images, expected = [], [], []
    for messages, pictures in conversations().values():
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
        ids, image_inputs = prompts.encode(text, pictures)
        inputs = hf_inputs(prompts, text, pictures)
        assert ids == inputs["input_ids"][0].tolist()
        token_ids.append(ids)
        images.append(image_inputs)
        expected.append(hf_greedy(hf, inputs))
    return token_ids, images, expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("batched_tokens", [512, 24])
def test_engine_greedy_equals_transformers_qwen2_5_vl(vlm, cases, batched_tokens, device):
    """All three conversations at once: whole prompts a step, and 24-token steps that split
    every image's placeholders over chunks (positions looked up per chunk). On CUDA (fp32):
    the GPU path (M-RoPE tables per step, decode graphs) against transformers on the CPU."""
    model_files, tokenizer, _ = vlm
    token_ids, images, expected = cases
    engine = Engine(SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=4),
                    WorkerConfig(device=device, dtype="float32", kv_cache_memory="16MiB"),
                    model_files)
    completions, _ = engine.generate(token_ids, [SamplingParams(
        max_tokens=NUM_NEW_TOKENS, temperature=0.0, logprobs=0)] * len(token_ids),
        images=images)
    assert [c.output_token_ids for c in completions] == [tokens for tokens, _ in expected]
    for completion, (_, hf_logprobs) in zip(completions, expected):
        np.testing.assert_allclose(completion.logprobs, hf_logprobs, atol=1e-3)
    assert len({tuple(tokens) for tokens, _ in expected}) == len(expected)  # images matter
    assert engine.runner.images.num_encoded == 2  # two distinct images; the rest cached


def test_hub_configs_read_as_a_qwen2_and_a_tower():
    """Qwen2.5-VL-7B-Instruct's Hub config.json shape: top-level text fields, rope_scaling
    of type mrope, the tower's in_chans."""
    from services.worker.model_config import ModelConfig
    from services.worker.qwen_vision import QwenVisionSpec

    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"],
              "image_token_id": 151655, "hidden_size": 3584, "intermediate_size": 18944,
              "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "vocab_size": 152064, "max_position_embeddings": 128000,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
              "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
              "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                                "num_heads": 16, "out_hidden_size": 3584, "in_chans": 3,
                                "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
                                "fullatt_block_indexes": [7, 15, 23, 31],
                                "temporal_patch_size": 2, "hidden_act": "silu"}}
    text = ModelConfig.from_dict(config)
    assert (text.family, text.num_layers, text.head_dim, text.qkv_bias) == ("qwen2", 28, 128,
                                                                            True)
    assert text.rope_parameters["rope_type"] == "default"
    spec = QwenVisionSpec.from_dict(config)
    assert (spec.patch_dim, spec.fullatt_block_indexes) == (1176, (7, 15, 23, 31))


def test_dummy_qwen2_5_vl_7b_preset():
    """``dummy:qwen2.5-vl-7b``: transformers' parameter count for the preset (language model
    and tower, on the meta device); the tokenizer tier's processor reads its directory (a
    640 x 640 image is 23 x 23 merge blocks, 529 placeholders); the tower draws random
    weights under its own names."""
    import json

    from transformers import AutoConfig

    from services.worker.model import Transformer
    from services.worker.model_config import ModelConfig
    from services.worker.qwen_images import random_tower_tensors
    from services.worker.qwen_vision import QwenVisionSpec, QwenVisionTower
    from shared.models import PRESETS_DIR, resolve_model

    config = json.loads((PRESETS_DIR / "qwen2.5-vl-7b.json").read_text())
    spec = QwenVisionSpec.from_dict(config)
    with torch.device("meta"):
        ours = sum(p.numel() for module in (Transformer(ModelConfig.from_dict(config)),
                                            QwenVisionTower(spec)) for p in module.parameters())
        hf = Qwen2_5_VLForConditionalGeneration(AutoConfig.for_model(**config))
    assert ours == sum(p.numel() for p in hf.parameters())
    assert round(ours / 1e9, 2) == 8.29  # Qwen2.5-VL-7B-Instruct's published 8.29B
    model_files = resolve_model("dummy:qwen2.5-vl-7b")
    assert model_files.dummy and model_files.name == "dummy-qwen2.5-vl-7b"
    from services.tokenizer.encoding import TextCodec

    codec = TextCodec(model_files.path)
    text = codec.tokenizer.apply_chat_template(chat(("user", [make_image(640, 640, 5), "?"])),
                                               add_generation_prompt=True, tokenize=False)
    ids, (image,) = codec.images.encode(text, [make_image(640, 640, seed=5)])
    assert image.grid_thw == [1, 46, 46] and image.length == 529
    assert ids.count(model_files.config["image_token_id"]) == 529
    small = QwenVisionSpec(**{**spec.__dict__, "depth": 2, "hidden_size": 32,
                              "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 16})
    tower = QwenVisionTower(small)
    tower.load_state_dict(random_tower_tensors(small, torch.device("cpu"), torch.float32),
                          strict=True)
    assert torch.equal(tower.blocks[0].norm1.weight, torch.ones(32))


def test_the_towers_mlp_padded_to_the_gemm_alignment_gives_the_checkpoints_output(vlm):
    """build_tower pads an MLP width of 40 to 64 with zeros: the same embeddings as the
    tower at the checkpoint's own shapes."""
    from dataclasses import replace
    from services.worker.qwen_images import random_tower_tensors
    from services.worker.qwen_vision import QwenVisionSpec, QwenVisionTower, build_tower
    model_files, _, _ = vlm
    spec = replace(QwenVisionSpec.from_dict(model_files.config), intermediate_size=40)
    tensors = random_tower_tensors(spec, torch.device("cpu"), torch.float32, std=0.2)
    padded = build_tower(spec, tensors)
    assert padded.blocks[0].mlp.gate_proj.weight.shape[0] == 64
    plain = QwenVisionTower(spec)
    plain.load_state_dict(tensors, strict=True)
    pixels = torch.randn(2 * 8 * 8, spec.patch_dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(padded(pixels, (2, 8, 8)), plain(pixels, (2, 8, 8)),
                                   rtol=1e-5, atol=1e-6)
