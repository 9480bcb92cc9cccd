"""The int GEMM's worker launches compiled for sm_90 without a GPU (tests/kernels/
int_gemm_compile.py in a subprocess, no interpreter): each compiles, fits an H200's shared
memory, spills no register and multiplies on the tensor cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H200_SHARED_BYTES = 232448  # the most dynamic shared memory a block may take (227 KiB)


def test_worker_launches_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "tests.kernels.int_gemm_compile"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout)
    assert any(r["config"]["block_m"] == 16 for r in results.values())  # decode
    assert any(r["config"]["block_m"] == 128 for r in results.values())  # prefill
    for name, r in results.items():
        assert r["shared"] <= H200_SHARED_BYTES, (name, r)
        if r["sass"] is not None:
            assert r["sass"]["spills"] == 0 and r["sass"]["mma"] > 0, (name, r)
