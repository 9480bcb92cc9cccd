"""The int GEMM's worker launches compiled for sm_90 without a GPU (tests/kernels/
int_gemm_compile.py in a subprocess, no interpreter): each compiles, fits an H200's shared
memory, spills no register, multiplies on the tensor cores, and with PDL on waits for the
previous kernel at its top level before it loads or stores anything (kernels/pdl.py's rules,
checked as tests/kernels/test_pdl.py checks the other decode kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
H200_SHARED_BYTES = 232448  # the most dynamic shared memory a block may take (227 KiB)


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_worker_launches_compile_for_hopper():
    assert_compiled_launches_fit()


@pytest.mark.gpu
def test_gpu_machine_triton_compiles_the_worker_launches():
    """The same with the device machine's Triton (3.6 there), still for sm_90."""
    assert_compiled_launches_fit()


def assert_compiled_launches_fit() -> None:
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
        ttir, ptx, sass = r["ttir"], r["ptx"], r["sass_pdl"]
        assert r["PDL"] and r["launch_pdl"], name
        assert (ttir["waits"], ttir["triggers"], ptx["waits"], ptx["triggers"]) == (1, 1, 1, 1)
        assert ttir["wait_top_level"] and ttir["trigger_after_wait"], name
        assert ttir["stores_before_wait"] == ptx["global_stores_before_wait"] == 0, name
        assert ttir["loads_before_wait"] == [] and ptx["global_loads_before_wait"] == 0, name
        if sass is not None:
            assert (sass["waits"], sass["triggers"]) == (1, 1), name
            assert sass["global_stores_before_wait"] == sass["global_loads_before_wait"] == 0
