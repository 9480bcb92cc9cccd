"""An Idefics3 (SmolVLM) checkpoint in the Hub's layout, built from SmolLM2-135M-Instruct's real
weights and a small seeded random SigLIP tower and connector: ``model.text_model.*`` (SmolLM2's
decoder, its embedding grown by the rows of SmolVLM's special tokens), ``model.vision_model.*``
(a SigLIP encoder of SmolVLM's geometry, 512-pixel tiles of 16-pixel patches, but a couple of
narrow layers), ``model.connector.*`` (pixel shuffle by 4, the projection), ``lm_head``. The
tokenizer gets SmolVLM's tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
``<row_i_col_j>``, ``<end_of_utterance>``), and the directory holds what transformers'
``AutoProcessor`` (Idefics3Processor) loads, with a ChatML template that takes image parts
(SmolLM2's own format, so the language model answers in it and stops on ``<|im_end|>``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.models import resolve_model

VISION_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_channels": 3, "image_size": 512,
                 "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
                 "model_type": "idefics3_vision"}
SCALE_FACTOR = 4  # 32 x 32 patches a tile -> 64 tokens
VOCAB_SIZE = 49280  # SmolVLM's: SmolLM2's 49,152 and room for the image tokens
# the longest edge images are resized to before they are cut into 512-pixel tiles (SmolVLM's
# processor takes 4 x 512; 2 x 512 keeps a test's images at up to 2 x 2 tiles and a global one)
LONGEST_EDGE = 1024
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<image>' }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def special_tokens() -> list[str]:
    """SmolVLM's tokens beyond SmolLM2's vocabulary, in the order they are added."""
    rows_cols = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    return ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
            *rows_cols]


def shared_idefics3_checkpoint(tmp_path_factory) -> Path:
    """One checkpoint for a pytest session (``smolvlm-tiny`` in its base temp dir), built by
    the first test module that asks (about 8 s)."""
    out = tmp_path_factory.getbasetemp() / "smolvlm-tiny"
    if not (out / "BUILT").exists():
        build_idefics3_checkpoint(out)
        (out / "BUILT").write_text("")
    return out


def build_idefics3_checkpoint(out: Path, seed: int = 0) -> Path:
    """The checkpoint directory at ``out`` (fp32)."""
    from transformers import AutoTokenizer, Idefics3ImageProcessor, Idefics3Processor

    smol = resolve_model("smollm2").path
    text_config = json.loads((smol / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(smol))
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens()})
    image_processor = Idefics3ImageProcessor(
        do_image_splitting=True, size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": VISION_CONFIG["image_size"]},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=64, chat_template=CHAT_TEMPLATE)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    assert len(tokenizer) <= VOCAB_SIZE, len(tokenizer)
    tensors = _tensors(load_file(str(smol / "model.safetensors")), text_config,
                       torch.Generator().manual_seed(seed))
    save_file({name: t.contiguous() for name, t in tensors.items()},
              str(out / "model.safetensors"))
    text_config = {key: value for key, value in text_config.items()
                   if not key.startswith("_") and key not in ("architectures", "id2label",
                                                              "label2id")}
    text_config.update(vocab_size=VOCAB_SIZE, tie_word_embeddings=False)
    config = {"architectures": ["Idefics3ForConditionalGeneration"], "model_type": "idefics3",
              "image_token_id": image_token_id, "scale_factor": SCALE_FACTOR,
              "tie_word_embeddings": False, "vision_config": VISION_CONFIG,
              "text_config": text_config, "pad_token_id": 2, "bos_token_id": 1,
              "eos_token_id": 2, "vocab_size": VOCAB_SIZE, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(smol / "generation_config.json", out / "generation_config.json")
    return out


def _tensors(smol: dict[str, torch.Tensor], text_config: dict, generator: torch.Generator
             ) -> dict[str, torch.Tensor]:
    """SmolLM2's tensors under ``model.text_model.``, the embedding grown to VOCAB_SIZE rows
    (new rows drawn at the scale of SmolLM2's), ``lm_head`` its copy, and the random tower."""
    tensors = {}
    for name, tensor in smol.items():
        if name == "lm_head.weight":
            continue
        tensors["model.text_model." + name.removeprefix("model.")] = tensor
    embed = tensors["model.text_model.embed_tokens.weight"]
    extra = torch.randn(VOCAB_SIZE - embed.shape[0], embed.shape[1], generator=generator)
    embed = torch.cat([embed, extra * embed.std()])
    tensors["model.text_model.embed_tokens.weight"] = embed
    tensors["lm_head.weight"] = embed.clone()
    tensors.update(vision_tensors(text_config["hidden_size"], generator))
    return tensors


def vision_tensors(text_hidden: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The random SigLIP tower and connector, in the Hub's names."""
    hidden, inter = VISION_CONFIG["hidden_size"], VISION_CONFIG["intermediate_size"]
    patch, channels = VISION_CONFIG["patch_size"], VISION_CONFIG["num_channels"]
    num_positions = (VISION_CONFIG["image_size"] // patch) ** 2

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=generator) * std

    prefix = "model.vision_model."
    tensors = {f"{prefix}embeddings.patch_embedding.weight": normal(hidden, channels, patch,
                                                                    patch, std=0.05),
               f"{prefix}embeddings.patch_embedding.bias": normal(hidden),
               f"{prefix}embeddings.position_embedding.weight": normal(num_positions, hidden),
               f"{prefix}post_layernorm.weight": 1 + normal(hidden, std=0.1),
               f"{prefix}post_layernorm.bias": normal(hidden)}
    for layer in range(VISION_CONFIG["num_hidden_layers"]):
        base = f"{prefix}encoder.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            tensors[f"{base}self_attn.{proj}.weight"] = normal(hidden, hidden, std=0.1)
            tensors[f"{base}self_attn.{proj}.bias"] = normal(hidden)
        for norm in ("layer_norm1", "layer_norm2"):
            tensors[f"{base}{norm}.weight"] = 1 + normal(hidden, std=0.1)
            tensors[f"{base}{norm}.bias"] = normal(hidden)
        tensors[f"{base}mlp.fc1.weight"] = normal(inter, hidden, std=0.1)
        tensors[f"{base}mlp.fc1.bias"] = normal(inter)
        tensors[f"{base}mlp.fc2.weight"] = normal(hidden, inter, std=0.1)
        tensors[f"{base}mlp.fc2.bias"] = normal(hidden)
    tensors["model.connector.modality_projection.proj.weight"] = normal(
        text_hidden, hidden * SCALE_FACTOR ** 2, std=0.05)
    return tensors
