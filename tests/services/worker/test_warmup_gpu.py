"""After start-up, serving compiles nothing: the runner's warm-up (attention variants, a
request's first steps) and the aligned step inputs leave no Triton kernel to compile in the
first requests, mixed, piecewise or eager (run on the device machine: pytest -m gpu)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
import triton

import kernels
from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from tests.services.worker.model_checks import runner_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def compiled_variants() -> dict[str, int]:
    """Compiled variants of each Triton kernel in kernels/, by name."""
    counts = {}
    for module_info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"kernels.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction):
                counts[f"{module_info.name}.{name}"] = sum(
                    len(caches[0]) for caches in value.device_caches.values())
    return counts


def test_first_requests_compile_nothing(dummy_model):
    runner = build_runner(WorkerConfig(device="cuda", dtype="bfloat16", kv_cache_memory="256MiB",
                                      max_model_len=2048, max_num_seqs=16,
                                      max_num_batched_tokens=2048), dummy_model)
    before = compiled_variants()
    # prompts of odd and even lengths: piecewise steps, and one past the graphs (eager)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 30_000, (n,), generator=generator).tolist()
               for n in (7, 16, 33, 700, 1)]
    runner_greedy(runner, prompts, 5)
    runner_greedy(runner, prompts[2:3], 3)
    after = compiled_variants()
    assert {name: after[name] - count for name, count in before.items()
            if after[name] != count} == {}
