"""A step's attention planned once and run for every layer (kernels/paged_attention.py's
``plan_attention``, kernels/repeated_launch.py): each layer's output is bitwise what a launch of
its own gives, and a plan takes only tensors laid out as the ones it was planned from.

On CPU under Triton's interpreter (every launch through the JIT); the `gpu` test runs the
compiled kernels' launchers that the layers after the first one use."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl
from kernels.paged_attention import paged_attention, plan_attention
from kernels.repeated_launch import RepeatedLaunch
from tests.kernels.test_paged_attention import make_batch

MIXED = [(23, 1), (1, 1), (64, 1), (40, 7), (9, 9), (33, 32)]  # (seq_len, q_len): decodes first
NUM_LAYERS = 3


def layers(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
           device="cpu"):
    """NUM_LAYERS (query, key_cache, value_cache) alike in layout, unlike in values (each
    layer's caches a slice of one allocation, as a worker binds them), and the step's
    metadata (block_tables, seq_lens, query_start_loc)."""
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = make_batch(
        seqs, block_size, num_heads, num_kv_heads, head_dim)
    gen = torch.Generator().manual_seed(1)
    caches = torch.randn(NUM_LAYERS, 2, *key_cache.shape, generator=gen).to(dtype).to(device)
    queries = torch.randn(NUM_LAYERS, *query.shape, generator=gen).to(dtype).to(device)
    per_layer = [(queries[i], caches[i, 0], caches[i, 1]) for i in range(NUM_LAYERS)]
    metadata = tuple(t.to(device) for t in (block_tables, seq_lens, query_start_loc))
    return per_layer, metadata


def bounds(seqs, num_decodes):
    return dict(max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs),
                num_decodes=num_decodes)


def check_plan_against_own_launches(seqs, num_decodes, device="cpu", dtype=torch.float32,
                                    **kwargs):
    per_layer, metadata = layers(seqs, device=device, dtype=dtype, **kwargs.pop("shape", {}))
    query, key_cache, value_cache = per_layer[0]
    out = torch.empty_like(query)
    plan = plan_attention(query, key_cache, value_cache, *metadata, out=out,
                          **bounds(seqs, num_decodes), **kwargs)
    for layer_query, layer_keys, layer_values in per_layer:
        assert plan.fits(layer_query, layer_keys, layer_values, out, False)
        planned = plan.run(layer_query, layer_keys, layer_values, 0.25, out=out).clone()
        alone = paged_attention(layer_query, layer_keys, layer_values, *metadata, 0.25,
                                **bounds(seqs, num_decodes), **kwargs)
        assert torch.equal(planned, alone)
    return plan


@pytest.mark.parametrize("num_segments", [None, 2], ids=["own_split", "split_in_two"])
def test_each_layer_equals_a_launch_of_its_own(num_segments):
    plan = check_plan_against_own_launches(MIXED, 3, num_segments=num_segments)
    assert len(plan.parts) == 2  # the decodes' launch and the chunks'
    assert all((part.combine is not None) == (num_segments == 2) for part in plan.parts)


def test_a_plan_without_out_allocates_one_each_layer():
    per_layer, metadata = layers(MIXED)
    plan = plan_attention(*per_layer[0], *metadata, **bounds(MIXED, 3))
    first = plan.run(*per_layer[0], 0.25)
    second = plan.run(*per_layer[1], 0.25)
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(second, paged_attention(*per_layer[1], *metadata, 0.25,
                                               **bounds(MIXED, 3)))


def test_a_plan_fits_only_what_it_was_planned_for(monkeypatch):
    per_layer, metadata = layers(MIXED)
    query, key_cache, value_cache = per_layer[0]
    out = torch.empty_like(query)
    plan = plan_attention(query, key_cache, value_cache, *metadata, out=out, **bounds(MIXED, 3))
    assert plan.fits(*per_layer[1], out, False) and plan.fits(*per_layer[2], None, False)
    storage = torch.empty(query.numel() + 1)
    off_alignment = storage[1:].view(query.shape)  # 4 bytes past a 16-byte boundary
    assert not plan.fits(off_alignment, key_cache, value_cache, out, False)
    assert not plan.fits(query.half(), key_cache, value_cache, out, False)
    assert not plan.fits(query[:-1], key_cache, value_cache, out, False)
    assert not plan.fits(query, key_cache[:, :8], value_cache, out, False)
    transposed = torch.empty(query.shape[1], query.shape[0], query.shape[2]).transpose(0, 1)
    assert not plan.fits(query, key_cache, value_cache, transposed, False)
    assert not plan.fits(query, key_cache, value_cache, out, True)  # --batch-invariant
    monkeypatch.setattr(pdl, "PDL", not plan.pdl)
    assert not plan.fits(query, key_cache, value_cache, out, False)


class FakeCompiled:
    """A compiled kernel: its launcher records the grid and positional arguments."""

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class FakeKernel:
    """A JIT kernel: records each launch's keyword arguments, returns a compiled kernel."""
    arg_names = ["a_ptr", "n", "BLOCK"]

    def __init__(self) -> None:
        self.jit_launches: list[dict] = []
        self.compiled_launches: list[tuple] = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.jit_launches.append(kwargs)
            return FakeCompiled(self.compiled_launches)
        return launch


def test_later_launches_take_the_compiled_kernels_launcher_in_signature_order():
    kernel = FakeKernel()
    launch = RepeatedLaunch(kernel, (3, 1), {"BLOCK": 16, "n": 5, "a_ptr": None},
                            {"num_warps": 4})
    launch(a_ptr="first")
    launch(a_ptr="second")
    launch(a_ptr="third", n=7)
    assert kernel.jit_launches == [{"a_ptr": "first", "n": 5, "BLOCK": 16, "num_warps": 4}]
    assert kernel.compiled_launches == [((3, 1, 1), ("second", 5, 16)),
                                        ((3, 1, 1), ("third", 7, 16))]
    assert launch.args == [None, 5, 16]  # what changed was for that launch only


def test_arguments_off_the_signature_are_refused():
    for args in ({"a_ptr": None, "n": 1}, {"a_ptr": None, "n": 1, "BLOCK": 16, "extra": 2}):
        with pytest.raises(ValueError, match="signature"):
            RepeatedLaunch(FakeKernel(), (1,), args, {})


# ---------------------------------------------------------------------------------------------
# GPU: the compiled launchers, at a real model's shapes
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_segments", [None, 4], ids=["own_split", "split_in_four"])
def test_gpu_layers_after_the_first_launch_compiled_kernels_bitwise_alike(num_segments):
    seqs = [(3000 + 17 * i, 1) for i in range(12)] + [(900, 60), (2048, 512)]
    plan = check_plan_against_own_launches(
        seqs, 12, device="cuda", dtype=torch.bfloat16, num_segments=num_segments,
        shape=dict(num_heads=32, num_kv_heads=8, head_dim=128))
    launches = [launch for part in plan.parts for launch in (part.attention, part.combine)
                if launch is not None]
    assert launches and all(launch.launcher is not None for launch in launches)
