"""A dummy vision-language model's tokenizer-tier files (shared/models.py ``dummy:``): the
default tokenizer lacks Qwen's vision tokens, so they are added and the preset's token ids
point at them; a preprocessor_config.json in the preset's geometry (Qwen2VLImageProcessor's
defaults otherwise) and a ChatML template that writes image parts as Qwen's does."""

from __future__ import annotations

import json
from pathlib import Path

QWEN2_5_VL = "Qwen2_5_VLForConditionalGeneration"
VISION_TOKENS = {"vision_start_token_id": "<|vision_start|>",
                 "vision_end_token_id": "<|vision_end|>", "image_token_id": "<|image_pad|>",
                 "video_token_id": "<|video_pad|>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen2VLImageProcessor's (and Qwen2.5-VL-7B-Instruct's) preprocessing
IMAGE_MEAN, IMAGE_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def is_dummy_vision_language(config: dict) -> bool:
    return (config.get("architectures") or [None])[0] == QWEN2_5_VL


def write_vision_files(config: dict, tokenizer_dir: Path, staging: Path) -> None:
    """Into ``staging``: the default tokenizer with the vision tokens (``config``'s ids set
    to theirs), the chat template, preprocessor_config.json."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    if len(tokenizer) > config["vocab_size"]:
        raise ValueError(f"preset vocab_size {config['vocab_size']} is smaller than the "
                         f"tokenizer's {len(tokenizer)} ids with the vision tokens")
    for key, token in VISION_TOKENS.items():
        config[key] = tokenizer.convert_tokens_to_ids(token)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(staging))
    (staging / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    vision = config["vision_config"]
    (staging / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
        "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": vision.get("patch_size", 14),
        "temporal_patch_size": vision.get("temporal_patch_size", 2),
        "merge_size": vision.get("spatial_merge_size", 2)}, indent=2))
