"""A tiny Qwen2.5-VL checkpoint with seeded random weights, saved by transformers' own
``Qwen2_5_VLForConditionalGeneration.save_pretrained`` (transformers 5's names:
``model.language_model.*``, ``model.visual.*``, ``lm_head``): a 2-layer Qwen2 decoder of
hidden 64 with M-RoPE sections (2, 3, 3), a 4-block vision tower of hidden 32 with 14-pixel
patches, 2 x 2 merging, 56-pixel windows (2 x 2 merge blocks) and full attention in blocks 1
and 3. The tokenizer is SmolLM2's (no Qwen tokenizer ships here) with Qwen's vision tokens
added; the directory holds the image processor's preprocessor_config.json
(Qwen2VLImageProcessor; transformers' processor class needs torchvision for its video side,
so the tokenizer tier builds the image and text side itself: qwen_images.py) and a ChatML template that writes an image part as Qwen's does
(``<|vision_start|><|image_pad|><|vision_end|>``)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.models import resolve_model

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 49280
# the processor's pixel budget: 4 to 48 merge blocks (28 x 28 pixels each) an image
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 48 * 28 * 28
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def shared_qwen2_5_vl_checkpoint(tmp_path_factory) -> Path:
    """One checkpoint for a pytest session (``qwen2.5-vl-tiny`` in its base temp dir)."""
    out = tmp_path_factory.getbasetemp() / "qwen2.5-vl-tiny"
    if not (out / "BUILT").exists():
        build_qwen2_5_vl_checkpoint(out)
        (out / "BUILT").write_text("")
    return out


def build_qwen2_5_vl_checkpoint(out: Path, seed: int = 0) -> Path:
    """The checkpoint directory at ``out`` (fp32)."""
    from transformers import (AutoTokenizer, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil)

    smol = resolve_model("smollm2").path
    tokenizer = AutoTokenizer.from_pretrained(str(smol))
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                               patch_size=14, merge_size=2,
                                               temporal_patch_size=2)
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
                     "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
                     "initializer_range": 0.1, "tie_word_embeddings": False,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                         "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                       "temporal_patch_size": 2, "window_size": 56,
                       "fullatt_block_indexes": [1, 3], "initializer_range": 0.1},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], bos_token_id=1, eos_token_id=2,
        pad_token_id=2, tie_word_embeddings=False)
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    image_processor.save_pretrained(str(out))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out
