"""Integer weights kept packed (int_weights.py, kernels/int_pack.py's layout): each format's
packed projections unpack to int_checkpoints' dequantization bit for bit, a packed model
computes what the dequantized one does, the checkpoints the layout cannot hold fall back to
dequantizing (saying why), and --quantization int4 rounds each projection to nearest.

On the CPU the worker dequantizes at load, so these tests let it pack on the CPU
(``packing_refusal`` patched) and run the torch reference of the kernels (ops.int_linear);
the ``gpu`` tests at the end serve packed checkpoints through the real kernels."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kernels.int_pack import IntLayout, dequantize
from kernels.paged_attention_ref import allocate_kv_cache
from services.worker import weights
from services.worker.config import WorkerConfig, host_error
from services.worker.int_checkpoints import checkpoint_int, dequantized_weights
from services.worker.int_weights import RTN_LAYOUT, packed_checkpoint, packing_refusal
from services.worker.runner_build import build_runner
from services.worker.weights import fuse_hf_weights, load_model, read_safetensors
from services.worker.model_config import ModelConfig
from shared.models import PRESETS_DIR, ModelFiles, resolve_model
from tests.services.worker.int_packing import (PROJECTIONS, awq_tensors,
                                               compressed_tensors_tensors, gptq_tensors,
                                               quantization_config)
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks
from tests.services.worker.test_int_checkpoints import FORMATS

CPU = torch.device("cpu")
PACKED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# a small Llama with room for groups of 64 and 128 (SmolLM2 is not on the GPU machine)
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "eos_token_id": None}


def write_random_int_checkpoint(out, method: str, bits: int = 4, group_size: int = 64,
                                act_order: bool = False, symmetric: bool = True,
                                num_layers: int = 2):
    """A random-weight Llama of SHAPE written in ``method``'s format by the tests' packers
    (int_packing.py): the projections quantized, everything else fp32."""
    config = json.loads((PRESETS_DIR / "tiny-llama.json").read_text())
    config.update(SHAPE, num_hidden_layers=num_layers, quantization_config=quantization_config(
        method, bits, group_size, act_order, symmetric))
    shapes = {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256),
              "self_attn.v_proj": (128, 256), "self_attn.o_proj": (256, 256),
              "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256), "mlp.down_proj": (256, 512)}
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(2048, 256, generator=gen) * 0.5,
               "model.norm.weight": torch.ones(256)}
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(256)
        tensors[f"{prefix}post_attention_layernorm.weight"] = torch.ones(256)
        for proj in PROJECTIONS:
            weight = torch.randn(*shapes[proj], generator=gen) * 0.05
            if method == "awq":
                packed, _ = awq_tensors(weight, group_size)
            elif method == "gptq":
                packed, _ = gptq_tensors(weight, bits, group_size, act_order, symmetric)
            else:
                packed, _ = compressed_tensors_tensors(weight, bits, group_size, symmetric,
                                                       act_order)
            tensors.update({f"{prefix}{proj}.{k}": t.contiguous() for k, t in packed.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return ModelFiles(name=method, path=out)


@pytest.fixture
def pack_on_cpu(monkeypatch):
    """Let load_model keep integer weights packed on the CPU (the reference ops run them)."""
    monkeypatch.setattr(weights, "packing_refusal", lambda *args: None)


def _config(path):
    return checkpoint_int(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("name", FORMATS)
def test_packed_layout_unpacks_to_the_dequantization_bit_exactly(name, tmp_path):
    """Every format: each fused projection of the packed layout, unpacked, equals the fused
    weights int_checkpoints dequantizes (the same fp32 values, in the activation's order)."""
    write_random_int_checkpoint(tmp_path, num_layers=1, **FORMATS[name])
    checkpoint = _config(tmp_path)
    raw = read_safetensors(tmp_path, CPU, torch.float32, int_refusal=None)
    model_config = ModelConfig.from_path(tmp_path)
    plain = fuse_hf_weights(dequantized_weights(raw, checkpoint, torch.float32), model_config)
    packed_hf, layout = packed_checkpoint(raw, checkpoint, num_layers=1)
    packed = fuse_hf_weights(packed_hf, model_config)
    assert layout.bits == checkpoint.bits and layout.group_size == checkpoint.group_size
    # one group: act-order's sort leaves the inputs in order, so no perm
    assert layout.act_order == (checkpoint.act_order and checkpoint.group_size > 0)
    for proj in PACKED:
        prefix = f"layers.0.{'self_attn' if proj in PACKED[:2] else 'mlp'}.{proj}"
        weight = _int_weight(packed, prefix, layout, plain[f"{prefix}.weight"].shape[1])
        assert torch.equal(dequantize(weight), plain[f"{prefix}.weight"]), (name, proj)
        assert f"{prefix}.weight" not in packed
    assert packed["embed_tokens.weight"] is raw["model.embed_tokens.weight"]


def _int_weight(state: dict, prefix: str, layout: IntLayout, in_features: int):
    from kernels.int_pack import IntWeight

    return IntWeight(state[f"{prefix}.int_qweight"], state[f"{prefix}.int_scales"],
                     state.get(f"{prefix}.int_zeros"), state.get(f"{prefix}.int_perm"),
                     layout.bits, layout.group_size, in_features)


@torch.inference_mode()
@pytest.mark.parametrize("name", ["awq-g64", "gptq-g64-act-order", "ct-w8a16-g64-asym"])
def test_a_packed_model_computes_what_the_dequantized_one_does(name, tmp_path, monkeypatch):
    """Chunked, paged steps through the packed model and the dequantized one: the same logits
    bit for bit (the reference multiplies the dequantized weight in fp32 as F.linear does)."""
    write_random_int_checkpoint(tmp_path, num_layers=2, **FORMATS[name])
    seq = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    steps, block_tables = [[(seq[:8], 0)], [(seq[8:], 8)]], [[5, 1, 7]]
    logits, configs = {}, {}
    for packed in (False, True):
        if packed:
            monkeypatch.setattr(weights, "packing_refusal", lambda *args: None)
        model = load_model(tmp_path, CPU, torch.float32)
        config = configs[packed] = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 8, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim,
                                              torch.float32, "cpu"))
        logits[packed] = torch.cat(run_chunks(model, steps, block_tables))
    assert configs[False].quantization == "none" and configs[False].int_layout is None
    assert configs[True].quantization == "int" and configs[True].int_layout is not None
    assert torch.equal(logits[True], logits[False])


def test_the_layout_refuses_what_it_cannot_hold(tmp_path):
    """Fused parts with different act-orders, or a projection left unquantized: a reason,
    the checkpoint's tensors untouched (load_model then dequantizes)."""
    write_random_int_checkpoint(tmp_path, num_layers=1, **FORMATS["gptq-g64-act-order"])
    checkpoint = _config(tmp_path)
    raw = read_safetensors(tmp_path, CPU, torch.float32, int_refusal=None)
    k_proj = "model.layers.0.self_attn.k_proj.g_idx"
    odd = {**raw, k_proj: raw[k_proj].flip(0)}
    assert "order their inputs differently" in packed_checkpoint(odd, checkpoint, 1)
    assert sorted(odd) == sorted(raw) and odd[k_proj] is not raw[k_proj]  # nothing taken out
    plain_k = {name: t for name, t in raw.items() if ".k_proj." not in name}
    plain_k["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(128, 256)
    assert packed_checkpoint(plain_k, checkpoint, 1) == (
        "model.layers.0.self_attn.k_proj is not quantized")


def test_where_integer_weights_are_not_kept_packed():
    cuda = torch.device("cuda")
    assert "CUDA" in packing_refusal(CPU, 1, False, "none")
    assert "tensor parallel" in packing_refusal(cuda, 2, False, "none")
    assert "MoE" in packing_refusal(cuda, 1, True, "none")
    assert "fp8" in packing_refusal(cuda, 1, False, "fp8")
    assert packing_refusal(cuda, 1, False, "int4") is None


@torch.inference_mode()
def test_int4_rounds_each_projection_of_a_dummy_model(pack_on_cpu):
    """--quantization int4 on dummy weights: only the projections are packed, each within
    half a step of its group of the same random weight, and the logits follow the plain
    model's."""
    tiny = resolve_model("dummy:tiny-llama")
    plain = load_model(tiny.path, CPU, torch.float32, seed=2)
    model = load_model(tiny.path, CPU, torch.float32, seed=2, quantization="int4")
    assert model.config.quantization == "int" and model.config.int_layout == RTN_LAYOUT
    plain_state, state = plain.state_dict(), model.state_dict()
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in PACKED:
            reference = plain_state[f"{name}.weight"]
            back = dequantize(module.kernel_weight)
            step = module.int_scales.float().T.repeat_interleave(128, 1)[:, :back.shape[1]]
            assert ((back - reference).abs() <= step / 2 + 1e-6).all(), name
            assert f"{name}.weight" not in state and module.weight is None
    assert torch.equal(state["embed_tokens.weight"], plain_state["embed_tokens.weight"])
    config = model.config
    seq = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for key, m in (("plain", plain), ("int4", model)):
        m.bind_kv_cache(allocate_kv_cache(config.num_layers, 8, BLOCK_SIZE,
                                          config.num_kv_heads, config.head_dim,
                                          torch.float32, "cpu"))
        out[key] = torch.cat(run_chunks(m, [[(seq, 0)]], [[5, 1, 7]]))
    cosine = torch.nn.functional.cosine_similarity(out["int4"], out["plain"], dim=-1)
    assert cosine.min() > 0.99, cosine
    assert not torch.equal(out["int4"], out["plain"])


def test_a_cpu_worker_refuses_int4_naming_the_flag():
    tiny = resolve_model("dummy:tiny-llama")
    with pytest.raises(ValueError, match="--quantization int4 needs a CUDA GPU"):
        build_runner(WorkerConfig(device="cpu", quantization="int4"), tiny)
    assert "int4 needs a CUDA GPU" in host_error(WorkerConfig(device="cpu",
                                                              quantization="int4"))


# ---- on the GPU: the real kernels (-m gpu)

GPU_FORMATS = ["awq-g64", "gptq-g64-act-order", "gptq-8bit-g64"]  # (no compressed-tensors there)


def _greedy(path, dtype: str, quantization: str = "none", enforce_eager: bool = False
            ) -> tuple[list[list[int]], ModelConfig]:
    """Greedy tokens of 12 random prompts (24 each) served on CUDA, and the model's config."""
    from cli.engine import Engine
    from services.scheduler.config import SchedulerConfig
    from shared.messages import SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 2000, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 90, (12,), generator=generator)]
    llm = Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64),
                 WorkerConfig(device="cuda", dtype=dtype, quantization=quantization,
                              kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=16,
                              enforce_eager=enforce_eager),
                 ModelFiles(name="int", path=path))
    greedy = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    completions, _ = llm.generate(prompts, greedy)
    config = llm.runner.model.config
    llm.close()
    return [c.output_token_ids for c in completions], config


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", GPU_FORMATS)
def test_gpu_packed_checkpoint_greedy_equals_the_dequantized_path(name, tmp_path, monkeypatch):
    """A checkpoint in each format served on CUDA (CUDA graphs, chunked prompts beside
    decodes), fp32: kept packed through the int GEMM, the greedy tokens of the same checkpoint
    dequantized at load (cuBLAS; fp32 sums in another order flip no token of this model)."""
    write_random_int_checkpoint(tmp_path, **FORMATS[name])
    packed, config = _greedy(tmp_path, "float32")
    assert config.quantization == "int" and config.int_layout is not None
    monkeypatch.setattr(weights, "packing_refusal", lambda *args: "the test's dequantized path")
    plain, plain_config = _greedy(tmp_path, "float32")
    assert plain_config.int_layout is None
    assert packed == plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_bf16_follows_the_dequantized_bf16_path(tmp_path, monkeypatch):
    """bf16: the packed model's tokens mostly the dequantized model's (a bf16 rounding may
    flip a near-tie of the random model, so most, not all)."""
    write_random_int_checkpoint(tmp_path, **FORMATS["awq-g64"])
    packed, _ = _greedy(tmp_path, "bfloat16")
    monkeypatch.setattr(weights, "packing_refusal", lambda *args: "the test's dequantized path")
    plain, _ = _greedy(tmp_path, "bfloat16")
    same = sum(a == b for p, q in zip(packed, plain) for a, b in zip(p, q))
    assert same >= 0.8 * sum(map(len, plain)), (same, packed, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_int4_dummy_graph_decode_equals_eager(dummy_model):
    """--quantization int4 on a dummy model: CUDA-graph steps give the eager steps' tokens."""
    graphs, config = _greedy(dummy_model.path, "float32", "int4")
    eager, _ = _greedy(dummy_model.path, "float32", "int4", enforce_eager=True)
    assert config.int_layout == RTN_LAYOUT
    assert graphs == eager


def _dummy_with(tmp_path, quantization: dict):
    from shared.models import DUMMY_MARKER

    config = json.loads((PRESETS_DIR / "tiny-llama.json").read_text())
    config.update(quantization_config=quantization, eos_token_id=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / DUMMY_MARKER).write_text("random weights\n")
    return tmp_path


@torch.inference_mode()
@pytest.mark.parametrize("method,symmetric", [("awq", False), ("gptq", True)])
def test_a_dummy_model_with_an_integer_config_draws_into_its_layout(method, symmetric, tmp_path,
                                                                   monkeypatch):
    """A dummy model whose config says AWQ g64 (zero points) or GPTQ 4-bit sym: random weights
    rounded into that layout (what dummy:llama-3.1-8b-awq runs, vLLM's dummy loader taking
    the same config); on the CPU, plain random weights (not packed)."""
    path = _dummy_with(tmp_path, quantization_config(method, 4, 64, symmetric=symmetric))
    assert load_model(path, CPU, torch.float32).config.int_layout is None
    plain = load_model(path, CPU, torch.float32, seed=1).state_dict()
    monkeypatch.setattr(weights, "packing_refusal", lambda *args: None)
    model = load_model(path, CPU, torch.float32, seed=1)
    assert model.config.int_layout == IntLayout(4, 64, zero_points=not symmetric,
                                                act_order=False)
    down = model.layers[0].mlp.down_proj
    back, reference = dequantize(down.kernel_weight), plain["layers.0.mlp.down_proj.weight"]
    step = down.int_scales.float().T.repeat_interleave(64, 1)
    assert ((back - reference).abs() <= step / 2 + 1e-6).all()
    assert (down.int_zeros is None) == symmetric
