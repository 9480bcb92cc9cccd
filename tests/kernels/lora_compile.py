"""Compile the LoRA kernels' launches (kernels/lora.py) for sm_90 as the worker makes them, at
Llama-3.1-8B's projections (rank 16 on all seven, and rank 64 on q/k/v): no GPU needed, only
Triton without TRITON_INTERPRET (tests/kernels/test_lora_compile.py runs it in a subprocess).
Per distinct launch: the shared memory it asks for and, from the SASS (nvdisasm from
Triton's wheel), its register spills and tensor-core instructions. Prints one JSON object.

    python -m tests.kernels.lora_compile
"""

from __future__ import annotations

import json
import sys

import torch

from kernels import lora
from kernels.lora_configs import BUCKETS, default_plan, plan_for
from tests.kernels import pdl_check
from tests.kernels.int_gemm_compile import sass_stats

# name -> (in_features, parts * rank, out_features)
SHAPES = {"qkv": (4096, 48, 6144), "o_proj": (4096, 16, 4096), "gate_up": (4096, 32, 28672),
          "down": (14336, 16, 4096), "qkv_r64": (4096, 192, 6144)}
ROWS = BUCKETS  # every row bucket's plan (kernels/lora_configs.py: swept, or the default)
DTYPES = (torch.bfloat16, torch.float32)


def main() -> None:
    pdl_check.KERNEL_MODULES = (lora,)
    lora._widen = lambda t: False  # (CPU tensors stand in for CUDA ones: no interpreter here)
    results, seen = {}, set()
    for name, (in_features, width, out_features) in SHAPES.items():
        for num_tokens in ROWS:
            for dtype in DTYPES if name == "qkv" else DTYPES[:1]:
                x = torch.empty(num_tokens, in_features, dtype=dtype)
                a = torch.empty(2, width, in_features, dtype=dtype)
                b = torch.empty(2, out_features, width, dtype=dtype)
                lora_rows = torch.zeros(1 + 2 * num_tokens, dtype=torch.int32)
                out = torch.empty(num_tokens, out_features, dtype=dtype)
                y = torch.empty(4, num_tokens, width, dtype=torch.float32)
                plan = plan_for(in_features, width, out_features, num_tokens, dtype)
                swept = plan != default_plan(num_tokens, width)
                recorded = pdl_check.record(lambda: (
                    lora.lora_shrink(x, a, lora_rows, plan.shrink),
                    lora.lora_expand(y, b, lora_rows, out, plan.expand)))
                for kernel, args, kwargs in recorded:
                    constexprs = tuple(sorted((k, v) for k, v in kwargs.items()
                                              if k.isupper()))
                    key = (kernel.__name__, str(dtype), constexprs)
                    if key in seen:
                        continue
                    seen.add(key)
                    compiled = pdl_check.compile_launch(kernel, args, kwargs)
                    results[f"{kernel.__name__}_{name}_m{num_tokens}_{dtype}"] = {
                        "constexprs": dict(constexprs), "shared": compiled.metadata.shared,
                        "swept": swept,
                        "sass": sass_stats(compiled.asm["cubin"])}
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
