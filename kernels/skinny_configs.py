"""The skinny GEMM's launch configs (kernels/skinny_gemm.py), per weight shape and dtype, as
swept on the H200: ``CONFIGS`` for bf16/fp16 weights (``benchmarks/gpu/skinny_gemm.py
--sweep``), ``FP8_CONFIGS`` for FP8 ones (``benchmarks/gpu/fp8_gemm.py --sweep``), and the
gated (gate_up + SwiGLU) launch's. A config is chosen by (N, K) alone, never by the number
of rows (batch invariance); ``max_m`` is the most rows at which it measured faster than the
alternative (cuBLAS, or the scaled FP8 GEMM), and the worker uses it only up to there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.fp8 import FP8_DTYPE


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    max_m: int = 0  # the worker uses it up to this many rows (measured faster than cuBLAS)


# (N, K) -> config, swept on the H200, 2026-11-23 (benchmarks/gpu/skinny_gemm.py --sweep; µs at
# M = 1 in a graph of back-to-back calls, against cuBLAS in the same run). TUNE
CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    (6144, 4096): SkinnyConfig(64, 256, num_stages=4, max_m=16),  # qkv: 15.3 vs 16.3
    (4096, 4096): SkinnyConfig(64, 128, split_k=4, max_m=16),  # o_proj: 12.0 vs 13.3
    (28672, 4096): SkinnyConfig(32, 128, max_m=4),  # gate_up: 55.6 vs 56.1; 0.99x at 8, 16
    (4096, 14336): SkinnyConfig(128, 128, split_k=4, num_stages=4, max_m=16),  # down: 30.7 vs 31.4
    (128256, 4096): SkinnyConfig(64, 128, max_m=16),  # lm_head: 231.5 vs 239.8
    # Llama-3.2-1B (speculative decoding's draft for the 8B), H200, 2026-11-27, µs at M = 1 / 8
    # against cuBLAS in the same run (`--sweep --shapes 1b_qkv,...`; measured up to 8 rows)
    (3072, 2048): SkinnyConfig(32, 256, num_stages=4, max_m=8),  # qkv: 5.8 / 5.8 vs 6.3 / 6.6
    (2048, 2048): SkinnyConfig(32, 256, num_stages=4, max_m=8),  # o_proj: 5.2 / 5.2 vs 6.2 / 6.2
    (16384, 2048): SkinnyConfig(64, 256, max_m=8),  # gate_up: 17.1 / 17.6 vs 18.4 / 18.4
    # down: 11.7 / 11.8 vs 13.7 / 13.8
    (2048, 8192): SkinnyConfig(32, 128, split_k=4, num_stages=4, max_m=8),
    # lm_head (tied embeddings): 117.7 / 120.9 vs 121.8 / 124.8
    (128256, 2048): SkinnyConfig(128, 128, num_stages=4, max_m=8),
    # one rank's Llama-3.1-8B at --tensor-parallel-size 2, swept on an H100 (no H200 was lent),
    # 2026-11-28, µs at M = 1 / 8 against cuBLAS in the same run (`--sweep --shapes tp2_qkv,...`;
    # measured up to 8 rows); unsplit, each also spares cuBLAS's split-K reduce (~2 µs)
    (3072, 4096): SkinnyConfig(32, 256, num_stages=4, max_m=8),  # qkv: 11.3 / 11.3 vs 13.7 / 14.5
    (4096, 2048): SkinnyConfig(32, 256, num_stages=4, max_m=8),  # o_proj: 8.1 / 8.1 vs 9.0 / 8.9
    (4096, 7168): SkinnyConfig(32, 256, num_stages=4, max_m=8),  # down: 22.8 / 23.1 vs 25.5 / 25.8
    # lm_head (vocab-parallel half): 172.7 / 175.2 vs 191.2 / 193.2
    (64128, 4096): SkinnyConfig(64, 256, num_stages=4, max_m=8),
    # Qwen3-30B-A3B's dense projections (qkv, o_proj, lm_head), 2026-12-02: configs of the
    # nearest swept shapes, not swept themselves; kept for the end-to-end batch-1 decode in
    # one lease: 3.611 ms against 3.692 with cuBLAS (`decode_latency --model
    # .devmodels/dummy-qwen3-30b-a3b [--skinny off]`, H200). TUNE
    (5120, 2048): SkinnyConfig(32, 256, num_stages=4, max_m=8),
    (2048, 4096): SkinnyConfig(32, 256, split_k=2, num_stages=4, max_m=8),
    (151936, 2048): SkinnyConfig(128, 128, num_stages=4, max_m=8),
}


# The fused gate_up + SwiGLU launch (``skinny_gemm_silu_and_mul``), keyed by the gate_up weight's
# (2 * d, K); block_n counts output columns (a program streams 2 * block_n weight rows). H200,
# 2026-11-23, M = 1, µs against gate_up (32, 128) + silu_and_mul's 57.3 in the same run: (32, 128)
# 56.8, (64, 128) 56.7, (16, 128) 64.8, (32, 256, 4 stages) 63.5, (32, 128, 8 warps) 81.1. TUNE
GATED_CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    (28672, 4096): SkinnyConfig(32, 128, max_m=4),
    # TP2's half (H100, 2026-11-28, `--sweep --gated --shapes tp2_gate_up`): M = 1 / 8 41.8 / 42.2
    # vs cuBLAS + silu_and_mul 43.5 / 45.0
    (14336, 4096): SkinnyConfig(32, 128, max_m=8),
}
# The gated launch on FP8 weights, H200, 2026-11-27 (benchmarks/gpu/fp8_gemm.py --sweep --gated;
# µs at M = 1 / 8 against the plain launch at its FP8_CONFIGS entry + silu_and_mul in the same
# run). Where it serves, the plain FP8 gate_up entries below are not used. TUNE
FP8_GATED_CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    (28672, 4096): SkinnyConfig(64, 256, max_m=16),  # 32.9 / 33.6 vs 34.3 / 34.7
    (57344, 8192): SkinnyConfig(64, 256, max_m=16),  # 115.9 / 116.9 vs 121.0 / 121.9
}

# The same for FP8 weights (a tile is half the bytes, multiplied in fp16: ``_fp16_dot``), H200,
# 2026-11-27 (benchmarks/gpu/fp8_gemm.py --sweep; µs at M = 1 / 8, against the same shape widened
# to bf16 at its best config before _fp16_dot, in the same run). Up to 16 rows each beats the
# scaled FP8 GEMM (qkv 19.8, o_proj 15.7, gate_up 48.1, down 42.7 µs at M = 16, its activation
# quantization included). TUNE
FP8_CONFIGS: dict[tuple[int, int], SkinnyConfig] = {
    # qkv: 11.5 / 12.3 vs 12.2 / 12.5
    (6144, 4096): SkinnyConfig(64, 128, split_k=4, max_m=16),
    # o_proj: 9.6 / 9.6 vs 10.2 / 10.3
    (4096, 4096): SkinnyConfig(128, 128, split_k=4, num_warps=8, num_stages=4, max_m=16),
    (28672, 4096): SkinnyConfig(128, 256, max_m=16),  # gate_up: 33.7 / 34.2 vs 40.3 / 40.5
    # down: 21.4 / 21.8 vs 24.1 / 24.4
    (4096, 14336): SkinnyConfig(128, 256, split_k=4, num_warps=8, max_m=16),
    # Llama-3.3-70B (the scaled FP8 GEMM at M = 1: 51.6, 45.0, 186.2, 125.2)
    (10240, 8192): SkinnyConfig(128, 128, split_k=4, max_m=16),  # qkv: 26.6 / 27.1 vs 31.1 / 31.9
    # o_proj: 21.7 / 22.4 vs 26.3 / 26.6
    (8192, 8192): SkinnyConfig(128, 128, split_k=4, num_warps=8, num_stages=4, max_m=16),
    # gate_up: 119.6 / 120.7 vs 147.5 / 147.8
    (57344, 8192): SkinnyConfig(128, 256, max_m=16),
    (8192, 28672): SkinnyConfig(128, 256, split_k=4, max_m=16),  # down: 60.8 / 62.8 vs 78.9 / 79.8
    # Qwen3-30B-A3B's qkv and o_proj (the experts take kernels/fused_moe.py), 2026-12-02: the
    # nearest swept shapes' configs, not swept (as its bf16 entries above). TUNE
    (5120, 2048): SkinnyConfig(64, 128, split_k=2, max_m=16),
    (2048, 4096): SkinnyConfig(64, 128, split_k=4, max_m=16),
}


def default_config(n: int, k: int) -> SkinnyConfig:
    """Shapes not swept: 16 columns per program, K in 256-wide tiles, no split."""
    return SkinnyConfig(block_n=16, block_k=min(256, max(16, triton.next_power_of_2(k))))


def table(dtype: torch.dtype) -> dict[tuple[int, int], SkinnyConfig]:
    """The plain launch's config table for weights of ``dtype``."""
    return FP8_CONFIGS if dtype == FP8_DTYPE else CONFIGS


def config_for(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> SkinnyConfig:
    """The launch for a [n, k] weight of ``dtype``."""
    return table(dtype).get((n, k)) or default_config(n, k)


def gated_table(dtype: torch.dtype) -> dict[tuple[int, int], SkinnyConfig]:
    """The gated launch's config table for gate_up weights of ``dtype``."""
    return FP8_GATED_CONFIGS if dtype == FP8_DTYPE else GATED_CONFIGS


def gated_config_for(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> SkinnyConfig:
    """The gated launch for a [n, k] gate_up weight of ``dtype`` (n / 2 output columns)."""
    return gated_table(dtype).get((n, k)) or default_config(n // 2, k)
