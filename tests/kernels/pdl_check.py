"""Compile the decode kernels for sm_90 as their launchers launch them and check where the
programmatic-dependent-launch wait sits (kernels/pdl.py's rules). Needs no GPU, only Triton
without TRITON_INTERPRET (tests/kernels/test_pdl.py runs it in a subprocess; on the device
machine it checks that Triton's code):

    python -m tests.kernels.pdl_check [--pdl on|off] [--ptx-digests]

Each case calls a launcher on CPU tensors with the kernels swapped for recorders, then compiles
every recorded launch with ``triton.compile``. Per launch it reports, from the TTIR: the waits
and triggers, whether the wait is at the function's top level (so every program runs it, before
any early return), and the kernel arguments that loads before the wait read; from the PTX: the
global loads and stores before the first ``griddepcontrol.wait``; from the SASS (nvdisasm from
Triton's wheel), the same. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import (activation, all_reduce_rms_norm, kv_cache, lora, lora_delta, paged_attention,
                     pdl, rms_norm, rotary, skinny_gemm, split_reduce)
from kernels.lora_configs import LoraPlan, default_plan

TARGET = GPUTarget("cuda", 90, 32)
KERNEL_MODULES = (activation, all_reduce_rms_norm, kv_cache, lora, paged_attention, rms_norm,
                  rotary, skinny_gemm, split_reduce)
OPTIONS = ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}
BF16 = torch.bfloat16


class Recorder:
    """Stands in for a JIT kernel in its module: records each launch instead of running it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches
        self.arg_names = kernel.arg_names  # (kernels/repeated_launch.py orders by them)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def record(launch) -> list:
    """The (kernel, args, kwargs) of every kernel launch ``launch()`` makes."""
    launches, saved = [], []
    for module in KERNEL_MODULES:
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                saved.append((module, name, value))
    try:
        for module, name, kernel in saved:
            setattr(module, name, Recorder(kernel, launches))
        launch()
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)
    return launches


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2 ** 31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature type for {value!r}")


def compile_launch(kernel, args, kwargs):
    """triton.compile of one recorded launch for TARGET."""
    names = kernel.arg_names
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k not in OPTIONS}
    constexprs = {(i,): bound[name] for i, (name, param) in enumerate(zip(names, kernel.params))
                  if param.is_constexpr}  # keyed by argument path, as every Triton 3.x takes
    signature = {name: "constexpr" if (i,) in constexprs else _arg_type(bound[name])
                 for i, name in enumerate(names)}
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    # as the JIT specializes: 16-byte aligned pointers and ints divisible by 16 (ints equal to
    # 1 are not: close enough for where a wait sits)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, param) in enumerate(
        zip(names, kernel.params)) if not param.is_constexpr and not param.do_not_specialize
        and _divisible(bound[name])}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                          options=options)


def _divisible(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _is_wait(line: str) -> bool:
    return "grid_dependency_wait" in line or "griddepcontrol.wait" in line


def _is_trigger(line: str) -> bool:
    return "grid_dependency_launch_dependents" in line or "griddepcontrol.launch_dependents" in line


def analyze_ttir(ttir: str, arg_names: list[str]) -> dict:
    """Waits, triggers, the wait's nesting, and the kernel arguments the loads before the first
    wait read (each load's pointer followed back through addptr/splat/broadcast/... to an
    argument of the function)."""
    lines = ttir.splitlines()
    func = next(i for i, line in enumerate(lines) if "tt.func" in line)
    # the function's arguments in order: %name (or %argN) -> the kernel's argument name
    params = re.findall(r"(%[\w.]+)\s*:", lines[func].split("(", 1)[1].rsplit(")", 1)[0])
    param_names = dict(zip(params, arg_names))
    body = [line for line in lines[func + 1:] if line.strip() and not line.lstrip().startswith("}")]
    top = len(body[0]) - len(body[0].lstrip())
    defs = {}
    for line in body:
        match = re.match(r"\s*(%[\w.#]+)(?::\d+)?\s*=\s*([\w.]+)\s+(.*)", line)
        if match:
            for name in re.findall(r"%[\w.]+", match.group(1)):
                defs[name] = (match.group(2), match.group(3))

    def root(value: str, depth: int = 0) -> str:
        if value in param_names:
            return param_names[value]
        op, rest = defs.get(value, ("?", ""))
        operands = re.findall(r"%[\w.]+", rest)
        if depth > 50 or not operands or op not in (
                "tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape",
                "tt.trans", "ttg.convert_layout"):
            return f"<{op}>"
        return root(operands[0], depth + 1)

    waits = [i for i, line in enumerate(body) if _is_wait(line)]
    triggers = [i for i, line in enumerate(body) if _is_trigger(line)]
    first_wait = waits[0] if waits else len(body)
    loads_before = sorted({root(re.findall(r"tt\.load\s+(%[\w.]+)", line)[0])
                           for line in body[:first_wait] if re.search(r"\btt\.load\b", line)})
    stores_before = sum(bool(re.search(r"\btt\.(store|atomic_\w+)\b", line))
                        for line in body[:first_wait])
    return {"waits": len(waits), "triggers": len(triggers),
            "wait_top_level": bool(waits) and len(body[waits[0]]) - len(
                body[waits[0]].lstrip()) == top,
            "trigger_after_wait": bool(waits) and all(t > waits[0] for t in triggers),
            "loads_before_wait": loads_before, "stores_before_wait": stores_before}


def analyze_ptx(ptx: str) -> dict:
    lines = [line.split("//")[0] for line in ptx.splitlines()]
    first_wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line),
                      len(lines))
    before = lines[:first_wait]
    return {"waits": sum("griddepcontrol.wait" in line for line in lines),
            "triggers": sum("griddepcontrol.launch_dependents" in line for line in lines),
            "global_loads_before_wait": sum(bool(re.search(r"\b(ld\.global|cp\.async)", line))
                                            for line in before),
            "global_stores_before_wait": sum(bool(re.search(r"\b(st\.global|atom\.|red\.)", line))
                                             for line in before)}


def analyze_sass(cubin: bytes) -> dict | None:
    """The same counts in the SASS (ptxas schedules it): ACQBULK is griddepcontrol.wait,
    PREEXIT griddepcontrol.launch_dependents. None without nvdisasm."""
    nvdisasm = Path(triton.backends.nvidia.__file__).parent / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([str(nvdisasm), "-c", file.name], capture_output=True, text=True,
                              check=True).stdout
    ops = [line.split("*/", 1)[1] for line in sass.splitlines()
           if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]  # the instructions, in order
    first_wait = next((i for i, op in enumerate(ops) if "ACQBULK" in op), len(ops))
    before = ops[:first_wait]
    return {"waits": sum("ACQBULK" in op for op in ops),
            "triggers": sum("PREEXIT" in op for op in ops),
            "global_loads_before_wait": sum(bool(re.search(r"\b(LDG|LDGSTS|UTMALDG)\b", op))
                                            for op in before),
            "global_stores_before_wait": sum(bool(re.search(r"\b(STG|ATOMG|REDG|RED|UTMASTG)\b",
                                                            op)) for op in before)}


def ptx_digest(ptx: str) -> str:
    """The PTX without line info: equal digests, the same code."""
    kept = [line for line in ptx.splitlines()
            if not line.lstrip().startswith((".loc", ".file", "$L__"))]
    text = "\n".join(kept).split(".section\t.debug", 1)[0]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _empty(*shape, dtype=BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _gemm(n: int, k: int, m: int = 1, **kwargs):
    return lambda: skinny_gemm.skinny_gemm(_empty(m, k), _empty(n, k), **kwargs)


def _attention(max_query_len: int, num_segments: int):
    """Llama-3.1-8B heads, block size 16: batch 1 (a decode) or one chunk of 16 queries."""
    num_tokens = max_query_len
    return lambda: paged_attention.paged_attention(
        _empty(num_tokens, 32, 128), _empty(64, 16, 8, 128), _empty(64, 16, 8, 128),
        torch.zeros(1, 64, dtype=torch.int32), torch.full((1,), 1024, dtype=torch.int32),
        torch.tensor([0, num_tokens], dtype=torch.int32), 0.088, max_query_len=max_query_len,
        max_seq_len=1024, num_segments=num_segments)


def _lora(num_tokens: int, in_features: int, width: int, out_features: int):
    """A LoRA projection's shrink and expand over 8 slots (rank 16: qkv's 3 parts, or one)."""
    def launch():
        lora_rows = torch.zeros(1 + 2 * num_tokens, dtype=torch.int32)
        y = lora.lora_shrink(_empty(num_tokens, in_features), _empty(8, width, in_features),
                             lora_rows)
        lora.lora_expand(y, _empty(8, out_features, width), lora_rows,
                         _empty(num_tokens, out_features))
    return launch


def _lora_beside(n: int, k: int, width: int, norm: bool = False):
    """A projection on the skinny GEMM with the LoRA shrink in its launch, then the expand
    (with ``norm``: into the residual before the reduce-and-norm)."""
    def launch():
        plan = default_plan(1, width)
        delta = lora_delta.LoraDelta(_empty(8, width, k), _empty(8, n, width),
                               torch.zeros(3, dtype=torch.int32),
                               LoraPlan(plan.shrink, plan.expand, beside=True))
        if norm:
            skinny_gemm.skinny_gemm_add_rms_norm(_empty(1, k), _empty(n, k), None,
                                                 _empty(1, n), _empty(n), 1e-5, lora=delta)
        else:
            skinny_gemm.skinny_gemm(_empty(1, k), _empty(n, k), lora=delta)
    return launch


def _rotary_kv():
    qkv = _empty(1, 6144)
    return kv_cache.rotary_and_write_kv_cache(
        qkv[:, :4096].view(1, 32, 128), qkv[:, 4096:5120].view(1, 8, 128),
        qkv[:, 5120:].view(1, 8, 128), torch.zeros(1, dtype=torch.int64),
        _empty(128, 128, dtype=torch.float32), _empty(64, 16, 8, 128), _empty(64, 16, 8, 128),
        torch.zeros(1, dtype=torch.int64))


# The Llama-3.1-8B decode launches (the worker's configs), and the other paths of each kernel
CASES = {
    "qkv": _gemm(6144, 4096),
    "o_proj_split": _gemm(4096, 4096),
    "o_proj_norm_in_reduce": lambda: skinny_gemm.skinny_gemm_add_rms_norm(
        _empty(1, 4096), _empty(4096, 4096), None, _empty(1, 4096), _empty(4096), 1e-5),
    "gate_up_silu": lambda: skinny_gemm.skinny_gemm_silu_and_mul(_empty(1, 4096),
                                                                  _empty(28672, 4096)),
    "down_split": _gemm(4096, 14336),
    "odd_k_bias_fp32": lambda: skinny_gemm.skinny_gemm(
        _empty(3, 100, dtype=torch.float32), _empty(40, 100, dtype=torch.float32),
        _empty(40, dtype=torch.float32),
        config=skinny_gemm.SkinnyConfig(block_n=16, block_k=32, split_k=3)),
    "rms_norm": lambda: rms_norm.rms_norm(_empty(1, 4096), _empty(4096), 1e-5),
    "add_rms_norm": lambda: rms_norm.rms_norm(_empty(1, 4096), _empty(4096), 1e-5,
                                              _empty(1, 4096)),
    "add_rms_norm_two_pass": lambda: rms_norm.rms_norm(_empty(1, 10000), _empty(10000), 1e-5,
                                                       _empty(1, 10000)),
    "rotary_and_write_kv_cache": _rotary_kv,
    "write_kv_cache": lambda: kv_cache.write_kv_cache(
        _empty(1, 8, 128), _empty(1, 8, 128), _empty(64, 16, 8, 128), _empty(64, 16, 8, 128),
        torch.zeros(1, dtype=torch.int64)),
    "apply_rotary": lambda: rotary.apply_rotary(
        _empty(1, 32, 128), _empty(1, 8, 128), torch.zeros(1, dtype=torch.int64),
        _empty(128, 128, dtype=torch.float32)),
    "silu_and_mul": lambda: activation.silu_and_mul(_empty(8, 28672)),
    "tp2_down_all_reduce_norm": lambda: all_reduce_rms_norm.all_reduce_add_rms_norm(
        _empty(2, 1, 4096, dtype=torch.float32), _empty(4096), _empty(1, 4096), _empty(4096),
        1e-5, torch.zeros(2, dtype=torch.int64), torch.zeros(256, dtype=torch.int64), 0, 2 << 20),
    "lora_qkv_decode": _lora(1, 4096, 48, 6144),
    "lora_down_prefill": _lora(1024, 14336, 16, 4096),
    "lora_qkv_beside_gemm": _lora_beside(6144, 4096, 48),
    "lora_down_beside_gemm_norm": _lora_beside(4096, 14336, 16, norm=True),
    "lora_gate_up_swiglu_expand": lambda: lora.lora_expand_silu_and_mul(
        _empty(16, 1, 32, dtype=torch.float32), _empty(8, 28672, 32),
        torch.zeros(3, dtype=torch.int32), _empty(1, 28672)),
    "attention_decode_split": _attention(1, 16),
    "attention_chunk": _attention(16, 1),
}
# the arguments a kernel may load before its wait (never written by a kernel: weights, LoRA
# slots and the step's LoRA rows, which host copies fill between steps)
WEIGHT_ARGS = {"_skinny_gemm_kernel": ["w_ptr"], "_shrink_kernel": ["a_ptr", "lora_rows_ptr"],
               "_expand_kernel": ["b_ptr", "lora_rows_ptr"],
               "_expand_silu_kernel": ["b_ptr", "lora_rows_ptr"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pdl", choices=["on", "off"], default="on")
    parser.add_argument("--ptx-digests", action="store_true",
                        help="also each launch's PTX digest (without line info)")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    pdl.PDL = args.pdl == "on"
    results = {}
    for case in args.cases.split(","):
        for index, (kernel, call_args, kwargs) in enumerate(record(CASES[case])):
            compiled = compile_launch(kernel, call_args, kwargs)
            runtime_args = [name for name, param in zip(kernel.arg_names, kernel.params)
                            if not param.is_constexpr]
            result = {"kernel": kernel.__name__, "launch_pdl": kwargs.get("launch_pdl", False),
                      "PDL": kwargs.get("PDL", False),
                      "ttir": analyze_ttir(compiled.asm["ttir"], runtime_args),
                      "ptx": analyze_ptx(compiled.asm["ptx"]),
                      "sass": analyze_sass(compiled.asm["cubin"]),
                      "weight_args": WEIGHT_ARGS.get(kernel.__name__, []),
                      "branch_waits": 1}
            if kwargs.get("LORA"):  # the skinny GEMM with LoRA shrink programs: a wait in each
                # branch (one program runs one), the shrink's first in the TTIR
                result.update(weight_args=WEIGHT_ARGS["_shrink_kernel"], branch_waits=2)
            if args.ptx_digests:
                result["ptx_digest"] = ptx_digest(compiled.asm["ptx"])
            results[f"{case}/{index}"] = result
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
