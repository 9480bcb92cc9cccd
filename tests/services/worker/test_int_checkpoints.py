"""Integer weight-only checkpoints (int_checkpoints.py), written from SmolLM2's real weights by
the tests' own round-to-nearest quantizer and packers (int_packing.py): the unpacked weights
equal the plain dequantization bit for bit in every format, the greedy text through the worker
equals transformers' on the dequantized fp32 copy, and bad checkpoints fail naming the field or
tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.int_checkpoints import checkpoint_int, unpack_awq, unpack_int32
from services.worker.model_config import ModelConfig
from services.worker.weights import check_quantization, load_model, read_safetensors
from tests.services.worker.int_packing import pack, write_int_checkpoint, write_plain
from tests.services.worker.model_checks import hf_greedy, make_runner, runner_greedy

CPU = torch.device("cpu")
FORMATS = {  # name: write_int_checkpoint's arguments
    "awq-g64": dict(method="awq"),
    "gptq-g64": dict(method="gptq"),
    "gptq-g64-act-order": dict(method="gptq", act_order=True),
    "gptq-8bit-g64": dict(method="gptq", bits=8),
    "gptq-8bit-one-group-act-order": dict(method="gptq", bits=8, group_size=-1, act_order=True),
    "gptq-g64-asym": dict(method="gptq", symmetric=False),
    "ct-w4a16-g64-sym": dict(method="compressed-tensors"),
    "ct-w4a16-g64-asym": dict(method="compressed-tensors", symmetric=False),
    "ct-w4a16-g64-actorder-group": dict(method="compressed-tensors", act_order=True),
    "ct-w8a16-channel-sym": dict(method="compressed-tensors", bits=8, group_size=-1),
    "ct-w8a16-g64-asym": dict(method="compressed-tensors", bits=8, symmetric=False),
}
EOS_TOKEN_ID = 2  # SmolLM2's <|im_end|>
PROMPTS = ["The capital of France is", "def add(a, b):"]


def test_awq_nibble_order_and_gptq_rows_unpack_known_words():
    # AutoAWQ packs columns 0..7 into nibbles as 0, 2, 4, 6, 1, 3, 5, 7 (lowest first)
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [
        list(range(8))]
    # GPTQ: eight consecutive input rows in a word, lowest bits first; a sign bit set
    word = torch.tensor([[0x76543210, -0x10000000]], dtype=torch.int32)  # [1, 2]
    assert unpack_int32(word, 4, dim=0)[:, 0].tolist() == list(range(8))
    assert unpack_int32(word, 4, dim=0)[:, 1].tolist() == [0] * 7 + [15]
    assert unpack_int32(word, 8, dim=1).tolist() == [[0x10, 0x32, 0x54, 0x76, 0, 0, 0, 0xF0]]


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_reverses_the_packers_and_compressed_tensors_own(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                       unpack_from_int32)

    values = torch.randint(0, 1 << bits, (24, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int32(pack(values, bits, 0), bits, dim=0), values.int())
    assert torch.equal(unpack_int32(pack(values, bits, 1), bits, dim=1), values.int())
    signed = (values - (1 << (bits - 1))).to(torch.int8)
    for dim in (0, 1):
        packed = pack_to_int32(signed, bits, packed_dim=dim)
        ours = unpack_int32(packed, bits, dim) - (1 << (bits - 1))
        assert torch.equal(ours, unpack_from_int32(packed, bits, signed.shape, dim).int())


@pytest.mark.parametrize("name", FORMATS)
def test_unpacked_weights_equal_the_plain_dequantization(name, tmp_path):
    plain = write_int_checkpoint(tmp_path, num_layers=2, **FORMATS[name])
    got = read_safetensors(tmp_path, CPU, torch.float32)
    assert sorted(got) == sorted(plain)
    unequal = [n for n in plain if not torch.equal(got[n], plain[n])]
    assert not unequal, unequal
    assert ModelConfig.from_path(tmp_path).quantization == "none"  # served dequantized
    assert check_quantization(tmp_path, "none", CPU) == "none"
    load_model(tmp_path, CPU, torch.float32)  # every tensor where the model wants it (strict)


def test_compressed_tensors_own_decompression_gives_the_same_weight_in_its_dtype(tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    write_int_checkpoint(tmp_path, num_layers=1, **FORMATS["ct-w4a16-g64-asym"])
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(**config["config_groups"]["group_0"])
    stored, ours = load_file(str(tmp_path / "model.safetensors")), read_safetensors(
        tmp_path, CPU, torch.float32)
    module = "model.layers.0.mlp.down_proj"
    parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.startswith(module + ".")}
    theirs = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]  # in bf16
    # ours is exact in fp32 (a bf16 scale times a 4-bit integer); theirs is that rounded once
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(ours[f"{module}.weight"].to(torch.bfloat16), theirs)


def test_fp8_on_top_of_an_integer_checkpoint_loads(tmp_path):
    """--quantization fp8 on an AWQ checkpoint: dequantized, then FP8 per channel as usual."""
    write_int_checkpoint(tmp_path, num_layers=1, **FORMATS["awq-g64"])
    model = load_model(tmp_path, CPU, torch.float32, quantization="fp8")
    assert model.config.quantization == "fp8"


@pytest.mark.parametrize("name", ["awq-g64", "gptq-g64-act-order", "ct-w4a16-g64-asym"])
def test_greedy_text_equals_transformers_on_the_dequantized_copy(name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = write_int_checkpoint(tmp_path / "int", **FORMATS[name])  # all 30 layers
    copy = write_plain(tmp_path / "plain", plain, tmp_path / "int")
    tokenizer = AutoTokenizer.from_pretrained(str(copy))
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    hf_model = AutoModelForCausalLM.from_pretrained(str(copy), dtype=torch.float32).eval()
    expected = hf_greedy(hf_model, prompts, 16)  # each up to its eos, if it comes
    got = runner_greedy(make_runner(tmp_path / "int", "2MiB"), prompts, 16)  # 16 tokens each
    assert [tokens[:len(hf)] for tokens, hf in zip(got, expected)] == expected
    assert all(len(hf) == 16 or hf[-1] == EOS_TOKEN_ID for hf in expected)
    assert "Paris" in tokenizer.decode(expected[0])  # 4-bit SmolLM2 still knows it


def _rewrite(path, config_change=None, tensor_change=None) -> None:
    if config_change:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"].update(config_change)
        (path / "config.json").write_text(json.dumps(config))
    if tensor_change:
        tensors = load_file(str(path / "model.safetensors"))
        tensor_change(tensors)
        save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("name, config_change, tensor_change, match", [
    ("gptq-g64", {"bits": 8}, None,
     r"proj\.qweight has shape \[\d+, \d+\], expected .* \(GPTQ 8-bit"),
    ("awq-g64", None, lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t[
        "model.layers.0.mlp.up_proj.qweight"][:, :-1].contiguous()}),
     r"mlp.up_proj.qweight has shape \[576, 191\], expected \[576, 192\]"),
    ("awq-g64", {"group_size": 128}, None,
     r"proj\.qweight holds \d+ inputs but .*proj\.scales has \d+ groups \(group_size 128"),
    ("ct-w4a16-g64-sym", None, lambda t: t.update({"model.layers.0.mlp.down_proj.weight_shape":
                                                   torch.tensor([576, 1600])}),
     r"down_proj.weight_packed has shape \[576, 192\], expected \[576, 200\]"),
    ("ct-w4a16-g64-asym", None, lambda t: t.pop("model.layers.0.self_attn.o_proj."
                                                "weight_zero_point"),
     r"o_proj.weight_zero_point is missing"),
    ("gptq-g64-act-order", None, lambda t: t.pop("model.layers.0.self_attn.k_proj.g_idx"),
     r"k_proj.g_idx is missing: an act-order checkpoint needs it"),
    ("gptq-g64", None, lambda t: t.pop("model.layers.0.self_attn.v_proj.qweight"),
     r"v_proj.(qzeros|scales|g_idx) has no qweight beside it"),
])
def test_tensors_that_disagree_with_the_config_fail_naming_the_tensor(
        name, config_change, tensor_change, match, tmp_path):
    write_int_checkpoint(tmp_path, num_layers=1, **FORMATS[name])
    _rewrite(tmp_path, config_change, tensor_change)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path, CPU, torch.float32)


@pytest.mark.parametrize("quantization, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"quant_method 'bitsandbytes' is not supported \(supported: awq, gptq, compressed-tensors"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 64},
     r"version is 'gemv'"),
    ({"quant_method": "awq", "version": "gemm", "bits": 3, "group_size": 64}, r"bits is 3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": False}, r"zero_point"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits is 3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"group_size is 0"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, r"checkpoint_format"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}}}, r"format is"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "tensor"}}}},
     r"config_groups.g.weights.strategy is 'tensor'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "channel"},
                              "input_activations": {"type": "int", "num_bits": 8}}}},
     r"config_groups.g quantizes activations"),
])
def test_unsupported_quantization_configs_are_refused_by_field(quantization, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_int({"quantization_config": quantization})


def test_an_unsupported_method_is_refused_when_the_model_loads(tmp_path):
    write_int_checkpoint(tmp_path, num_layers=1, **FORMATS["awq-g64"])
    _rewrite(tmp_path, {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported.*awq, gptq"):
        load_model(tmp_path, CPU, torch.float32)
    assert checkpoint_int({}) is None
    assert checkpoint_int({"quantization_config": {"quant_method": "fp8"}}) is None
