"""KV copies with the host arena on a real GPU (run on the device machine: pytest -m gpu): the
arena is pinned, blocks round-trip bit for bit through staging chunks, a store reads a
block's values from before a write the next step makes (the compute stream waits for the
copy), a forward queued after a load sees the loaded values, and a fresh runner (CUDA graphs,
overlapped steps) that loads a prompt's blocks continues it with the uncached greedy tokens."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.kv_offload import KvOffload
from services.worker.kv_tiers import KvTiers
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from shared.kv_arena import KvArena
from shared.messages import KvLoad, KvStoreRun, NewRequestData, SamplingParams, \
    ScheduledRequest, StepPlan
from shared.models import ModelFiles
from tests.services.worker.kv_arenas import offload_to_new_arena

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64)


@pytest.fixture
def arena_dir():
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    yield path
    shutil.rmtree(path)


def setup(arena_dir: Path, dtype: torch.dtype, num_slots: int = 48,
          max_staging_bytes: int = 1 << 20) -> KvTiers:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = allocate_kv_cache(SHAPE["num_layers"], SHAPE["num_blocks"], SHAPE["block_size"],
                              SHAPE["num_kv_heads"], SHAPE["head_dim"], dtype,
                              torch.device("cuda"))
    cache.copy_(torch.randn(cache.shape, device="cuda"))
    slot_nbytes = cache[:, :, 0].numel() * cache.element_size()
    arena = KvArena.create(arena_dir / "arena", num_slots, slot_nbytes, "store-1")
    return KvTiers(cache, arena, max_staging_bytes=max_staging_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_through_pinned_arena_is_bit_identical(arena_dir, dtype):
    tiers = setup(arena_dir, dtype)
    assert tiers.pinned
    assert tiers.staging_blocks < 20  # several chunks
    cache = tiers.kv_cache
    original = cache.clone()
    stored = list(range(10, 30)) + [3, 50, 7, 41]  # a long run, then scattered
    slot_ids = list(range(5, 25)) + [40, 2, 30, 31]
    tiers.store(stored, slot_ids)
    tiers.synchronize()
    assert tiers.completed() and not tiers.has_pending
    cache.zero_()
    loaded = [60 - i for i in range(20)] + [0, 1, 2, 63]
    timing = tiers.load(slot_ids, loaded)
    torch.cuda.synchronize()
    assert timing.bytes_per_s() > 0
    for s, b in zip(stored, loaded):
        assert torch.equal(cache[:, :, b].view(torch.uint8), original[:, :, s].view(torch.uint8))
    tiers.close()


def test_a_store_reads_the_values_from_before_the_next_write(arena_dir):
    tiers = setup(arena_dir, torch.bfloat16)
    cache = tiers.kv_cache
    blocks, slot_ids = [4, 5, 6, 20], [0, 1, 2, 3]
    # A warm-up round first, or a device-wide sync hides a missing wait: the write below
    # takes its block ids from the device (a pageable copy waits for every stream), and
    # every kernel involved is loaded (CUDA loads a kernel at its first launch, syncing).
    written = torch.tensor(blocks, device="cuda")
    tiers.store(blocks, slot_ids)
    tiers.wait_for_stores(blocks)
    cache.index_fill_(2, written, 1.0)
    tiers.synchronize()
    cache.copy_(torch.randn(cache.shape, device="cuda"))
    before = cache[:, :, blocks].clone()
    # hold the copy stream back so that an unordered overwrite would surely come first
    with torch.cuda.stream(tiers._copy_stream):
        torch.cuda._sleep(200_000_000)
    tiers.store(blocks, slot_ids)
    tiers.wait_for_stores([5, 33])  # the next step writes block 5: it waits for the copy
    cache.index_fill_(2, written, 7.0)  # the next step's write, on the compute stream
    overwritten = torch.cuda.Event()
    overwritten.record()
    time.sleep(0.02)
    assert not overwritten.query()  # the write waits behind the held-back copy
    tiers.synchronize()
    assert torch.equal(tiers.slots[slot_ids].permute(1, 2, 0, 3, 4, 5).cuda(), before)
    torch.cuda.synchronize()
    assert (cache[:, :, blocks] == 7.0).all()
    tiers.close()


def test_a_load_runs_after_the_work_before_it_and_before_the_work_that_waits_for_it(arena_dir):
    tiers = setup(arena_dir, torch.float32)
    values = torch.randn((3, *tiers.slot_shape))
    tiers.slots[[8, 9, 12]] = values
    torch.cuda._sleep(100_000_000)  # the compute stream is busy: the load must queue behind
    tiers.kv_cache[:, :, [30, 31, 2]] = 7.0  # (a step in flight writing the blocks' old use)
    tiers.load([8, 9, 12], [30, 31, 2])
    assert len(tiers.pending_loads) == 1
    tiers.wait_for_loads([2, 50])  # a step reading block 2 next
    seen = tiers.kv_cache[:, :, [30, 31, 2]].sum(dim=(0, 1, 3, 4, 5))  # [3], queued after
    assert torch.allclose(seen.cpu(), values.sum(dim=(1, 2, 3, 4, 5)), rtol=1e-4, atol=1e-2)
    tiers.close()




def make_runner(model_files: ModelFiles) -> ModelRunner:
    # fp32: a near-flat random model's greedy tokens must not flip on a bf16 rounding
    return build_runner(WorkerConfig(device="cuda", dtype="float32", kv_cache_memory="64MiB",
                                    max_model_len=512, max_num_seqs=8, overlap_steps="on"),
                       model_files)


def greedy_run(runner: ModelRunner, token_ids: list[int], block_ids: list[int],
               num_computed: int, num_new_tokens: int, kv_loads=(), kv_stores=(),
               load_alone: bool = False) -> list[int]:
    """A prompt, then decode steps (CUDA graphs, each queued before the last is read back).
    ``load_alone``: the loads come in a step of their own, as the scheduler plans them; else
    in the prompt's step, which must then wait for them on the device."""
    sampling = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True)
    new = [NewRequestData("r", token_ids, sampling, block_ids, num_computed)]
    plans = [StepPlan(0, new, [], kv_loads=list(kv_loads))] if load_alone else []
    plans += [StepPlan(len(plans), [] if load_alone else new,
                       [ScheduledRequest("r", len(token_ids) - num_computed)],
                       kv_loads=[] if load_alone else list(kv_loads), kv_stores=list(kv_stores))]
    first = len(plans)
    plans += [StepPlan(step_id, [], [ScheduledRequest("r", 1)])
              for step_id in range(first, first + num_new_tokens - 1)]
    outputs = []
    for plan in plans:
        outputs += [token for r in runner.submit(plan) for token in r.sampled_token_ids]
    outputs += [token for r in runner.flush() for token in r.sampled_token_ids]
    return outputs


@pytest.mark.parametrize("load_alone", [False, True])
def test_a_fresh_runner_continues_from_loaded_blocks(dummy_model, arena_dir, load_alone):
    prompt = torch.randint(5, 40_000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    writer = make_runner(dummy_model)
    offload = offload_to_new_arena(writer, arena_dir / "arena")
    expected = greedy_run(writer, prompt, list(range(8)), 0, 20, kv_stores=[
        KvStoreRun("r", 0, [0, 1, 2, 3], [b"0", b"1", b"2", b"3"])])
    writer.flush()
    while offload.poll():
        pass
    (commit,) = offload.take_commits()
    slot_ids = commit.slot_ids
    assert commit.token_ids == prompt[:4 * 16] and commit.block_size == 16

    reader = make_runner(dummy_model)
    reader.attach_kv(KvOffload(KvTiers(reader.kv_cache, KvArena.attach(arena_dir / "arena")),
                               "store-1", reader.block_size))
    block_ids = [40, 12, 33, 7, 8, 9, 10, 11]
    loaded = greedy_run(reader, prompt, block_ids, 64, 20,
                        kv_loads=[KvLoad(slot_ids, block_ids[:4])], load_alone=load_alone)
    assert loaded == expected
