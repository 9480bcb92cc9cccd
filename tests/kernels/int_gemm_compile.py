"""Compile the int GEMM's launches (kernels/int_gemm.py) for sm_90 as the worker makes them, at
the Llama-3.1-8B shapes: no GPU needed, only Triton without TRITON_INTERPRET
(tests/kernels/test_int_gemm_compile.py runs it in a subprocess). Per distinct launch it
reports the shared memory the kernel asks for and, from the SASS (nvdisasm from Triton's
wheel), its instructions, register spills (LDL/STL) and tensor-core instructions. Prints one
JSON object. PDL is on, as on an H200: where the wait sits, as tests/kernels/pdl_check.py
reports it (the wait at the top level, nothing loaded or stored before it).

    python -m tests.kernels.int_gemm_compile
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from kernels import int_gemm, pdl, split_reduce
from kernels.int_gemm import decode_config, prefill_config
from kernels.int_pack import IntWeight
from tests.kernels import pdl_check

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = (1, 16, 32, 64, 256, 4096)
# (x dtype, bits, zero points, act-order): each distinct launch compiles with the next
VARIANTS = ((torch.bfloat16, 4, True, False), (torch.bfloat16, 4, False, True),
            (torch.float16, 8, True, False), (torch.bfloat16, 8, False, False))


def empty_weight(n: int, k: int, bits: int, zero_points: bool, act_order: bool) -> IntWeight:
    groups = -(-k // 128)
    return IntWeight(torch.empty(-(-k // (32 // bits)), n, dtype=torch.int32),
                     torch.empty(groups, n, dtype=torch.float16),
                     torch.empty(groups, n, dtype=torch.uint8) if zero_points else None,
                     torch.empty(k, dtype=torch.int32) if act_order else None, bits, 128, k)


def sass_stats(cubin: bytes) -> dict | None:
    nvdisasm = Path(triton.backends.nvidia.__file__).parent / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([str(nvdisasm), "-c", file.name], capture_output=True, text=True,
                              check=True).stdout
    ops = [line.split("*/", 1)[1] for line in sass.splitlines()
           if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line)]
    return {"instructions": len(ops),
            "spills": sum(bool(re.search(r"\b(LDL|STL)\b", op)) for op in ops),
            "mma": sum(bool(re.search(r"HMMA|HGMMA", op)) for op in ops)}


def launches() -> dict[str, tuple]:
    """name -> (config, m, n, k) of each distinct (bits, config) the worker launches."""
    found = {}
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            for bits in (4, 8):
                config = (decode_config(bits, n, k) if m <= int_gemm.DECODE_MAX_M
                          else prefill_config(bits, m, n, k))
                key = (bits, config.block_m, config.block_n, config.block_kw,
                       config.split_k > 1, config.num_warps, config.num_stages, config.one_dot)
                found.setdefault(key, (f"{name}_m{m}_int{bits}", config, m, n, k))
    return {name: rest for name, *rest in found.values()}


def main() -> None:
    pdl_check.KERNEL_MODULES = (int_gemm, split_reduce)
    pdl_check.DTYPES[torch.uint8] = "u8"
    pdl.PDL = True
    results = {}
    variants = {bits: [v for v in VARIANTS if v[1] == bits] for bits in (4, 8)}
    counts = {4: 0, 8: 0}
    for name, (config, m, n, k) in launches().items():
        bits = 4 if "int4" in name else 8
        dtype, _, zero_points, act_order = variants[bits][counts[bits] % len(variants[bits])]
        counts[bits] += 1
        x = torch.empty(m, k, dtype=dtype)
        weight = empty_weight(n, k, bits, zero_points, act_order)
        recorded = pdl_check.record(lambda: int_gemm.int_gemm(x, weight, config=config))
        kernel, args, kwargs = next(r for r in recorded if r[0].__name__ == "_int_gemm_kernel")
        compiled = pdl_check.compile_launch(kernel, args, kwargs)
        runtime_args = [arg for arg, param in zip(kernel.arg_names, kernel.params)
                        if not param.is_constexpr]
        results[name] = {"config": vars(config), "dtype": str(dtype), "zero_points": zero_points,
                         "act_order": act_order, "shared": compiled.metadata.shared,
                         "sass": sass_stats(compiled.asm["cubin"]),
                         "PDL": kwargs.get("PDL"), "launch_pdl": kwargs.get("launch_pdl"),
                         "ttir": pdl_check.analyze_ttir(compiled.asm["ttir"], runtime_args),
                         "ptx": pdl_check.analyze_ptx(compiled.asm["ptx"]),
                         "sass_pdl": pdl_check.analyze_sass(compiled.asm["cubin"])}
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
