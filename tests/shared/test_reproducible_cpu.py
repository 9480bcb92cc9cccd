"""CPU math that does not depend on the thread or the batch (shared/reproducible_cpu.py).

Without MKL's reproducibility mode, on an AMD EPYC two-core machine a (sequence, head) of SDPA
computed on the OpenMP worker thread differed in its last bit from the same one computed on
the main thread (``MKL_CBWR= pytest this file`` shows it there; Intel CPUs agree either way)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shared.reproducible_cpu import MKL_CBWR_ENV, require_reproducible_blas


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_sequences_attention_does_not_depend_on_its_batch(two_threads):
    generator = torch.Generator().manual_seed(0)
    num_seqs, num_kv_heads, group, padded_len, head_dim = 3, 2, 3, 48, 16
    query = torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=generator)
    keys = torch.randn(num_seqs, num_kv_heads, padded_len, head_dim, generator=generator)
    values = torch.randn(num_seqs, num_kv_heads, padded_len, head_dim, generator=generator)
    lens = torch.tensor([41, 19, 30])
    # [num_seqs, 1, 1, padded_len]
    valid = (torch.arange(padded_len)[None, :] < lens[:, None])[:, None, None, :]
    batched = F.scaled_dot_product_attention(query, keys, values, attn_mask=valid, scale=0.25)
    for seq in range(num_seqs):  # alone, its heads run on other threads than in the batch
        rows = slice(seq, seq + 1)
        alone = F.scaled_dot_product_attention(query[rows], keys[rows], values[rows],
                                               attn_mask=valid[rows], scale=0.25)
        torch.testing.assert_close(alone[0], batched[seq], rtol=0, atol=0)


def test_the_worker_entry_point_sets_it_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != MKL_CBWR_ENV}
    printed = subprocess.run(
        [sys.executable, "-c", "import os, services.worker.__main__; "
         f"print(os.environ['{MKL_CBWR_ENV}'])"],
        env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert printed.strip() == "AUTO"


def test_asking_after_torch_loaded_warns_and_still_sets_it_for_child_processes(monkeypatch):
    monkeypatch.delenv(MKL_CBWR_ENV, raising=False)
    with pytest.warns(UserWarning, match="after torch was imported"):
        assert require_reproducible_blas() is False
    assert os.environ[MKL_CBWR_ENV] == "AUTO"


def test_an_operators_choice_is_kept(monkeypatch):
    monkeypatch.setenv(MKL_CBWR_ENV, "AVX512")
    require_reproducible_blas()
    assert os.environ[MKL_CBWR_ENV] == "AVX512"
