"""Loads in layer groups on a real GPU (run on the device machine: pytest -m gpu): a grouped
load gives bit for bit the blocks an ungrouped one gives (consecutive and random slots,
uneven groups); a layer read after its group's event sees the loaded values while the load
is held back; and a runner loading a prompt's blocks in 4 groups, eager or with piecewise
graphs, gives the greedy tokens of 1 group and of an uncached run, for the loading request
and for a second request of the same step that reads the loading blocks."""

from __future__ import annotations

import json
import random
import shutil
import tempfile
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
from shared.models import DUMMY_MARKER, PRESETS_DIR, ModelFiles
from tests.services.worker.kv_arenas import offload_to_new_arena

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 96, 16, 4, 64
HOLD_CYCLES = 100_000_000  # torch.cuda._sleep: ~50 ms, so an unordered read surely comes first


@pytest.fixture
def arena_dir():
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    yield path
    shutil.rmtree(path)


def make_cache() -> torch.Tensor:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    return allocate_kv_cache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                             torch.bfloat16, torch.device("cuda"))


def filled_arena(arena_dir: Path, num_slots: int) -> Path:
    slot_nbytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    arena = KvArena.create(arena_dir / "arena", num_slots, slot_nbytes, "store-1")
    slots = torch.from_numpy(arena.slots()).view(torch.bfloat16)
    slots.copy_(torch.randn(slots.shape, generator=torch.Generator().manual_seed(0)))
    del slots  # (the mapping closes only once no view is left)
    arena.close()
    return arena_dir / "arena"


@pytest.mark.parametrize("num_groups", [2, 4, 6])
@pytest.mark.parametrize("slots_kind", ["consecutive", "random"])
def test_a_grouped_load_equals_an_ungrouped_one_bit_for_bit(arena_dir, num_groups, slots_kind):
    path = filled_arena(arena_dir, 80)
    rng = random.Random(num_groups)
    slot_ids = list(range(5, 75)) if slots_kind == "consecutive" else rng.sample(range(80), 70)
    block_ids = rng.sample(range(NUM_BLOCKS), 70)
    caches = {}
    for groups in (1, num_groups):
        cache = make_cache()
        cache.fill_(-3.0)
        # 256 KiB of staging: 2 blocks a chunk ungrouped, more grouped; many chunks either way
        tiers = KvTiers(cache, KvArena.attach(path), max_staging_bytes=256 << 10,
                        num_load_groups=groups)
        assert tiers.pinned
        timing = tiers.load(slot_ids, block_ids)
        torch.cuda.synchronize()
        assert len(timing.group_ends) == (0 if groups == 1 else len(tiers.load_groups))
        assert all(event.query() for event in timing.group_ends)
        expected = tiers.slots[slot_ids].cuda()  # [70, num_layers, 2, block_size, ...]
        assert torch.equal(cache.permute(2, 0, 1, 3, 4, 5)[block_ids].view(torch.int16),
                           expected.view(torch.int16))
        caches[groups] = cache
        tiers.close()
    assert torch.equal(caches[1].view(torch.int16), caches[num_groups].view(torch.int16))


def test_a_layer_read_after_its_groups_event_sees_the_loaded_values(arena_dir):
    path = filled_arena(arena_dir, 40)
    cache = make_cache()
    tiers = KvTiers(cache, KvArena.attach(path), max_staging_bytes=256 << 10, num_load_groups=3)
    slot_ids, block_ids = list(range(30)), list(range(50, 80))
    index = torch.tensor(block_ids, device="cuda")  # (a pageable index copy could sync)
    # warm-up: kernels load at first launch, which syncs and would hide a missing wait
    tiers.load(slot_ids, block_ids)
    tiers.synchronize()
    cache.fill_(7.0)
    with torch.cuda.stream(tiers._load_stream):  # the load queues behind this
        torch.cuda._sleep(HOLD_CYCLES)
    tiers.load(slot_ids, block_ids)
    per_layer = tiers.wait_for_loads(block_ids, written_block_ids=[90], by_layer=True)
    assert per_layer is not None and [len(events) for events in per_layer] == [1, 0, 1, 0, 1, 0]
    seen = []
    for layer in range(NUM_LAYERS):  # the forward's attentions, on the compute stream
        for event in per_layer[layer]:
            torch.cuda.current_stream().wait_event(event)
        seen.append(cache[layer].index_select(1, index))  # [2, 30, block_size, ...]
    torch.cuda.synchronize()
    expected = tiers.slots[slot_ids].cuda()  # [30, num_layers, 2, ...]
    for layer in range(NUM_LAYERS):
        assert torch.equal(seen[layer], expected[:, layer].transpose(0, 1))
    tiers.close()


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory) -> ModelFiles:
    """tiny-llama with 6 layers: 4 groups are uneven ([0, 1), [1, 3), [3, 4), [4, 6))."""
    path = tmp_path_factory.mktemp("tiny-llama-6")
    config = json.loads((PRESETS_DIR / "tiny-llama.json").read_text())
    config.update(eos_token_id=None, num_hidden_layers=NUM_LAYERS)
    (path / "config.json").write_text(json.dumps(config))
    (path / DUMMY_MARKER).write_text("random weights\n")
    return ModelFiles(name="tiny-llama-6", path=path)


def make_runner(model_files: ModelFiles, enforce_eager: bool = False,
                groups: int = 1) -> ModelRunner:
    # fp32: a near-flat random model's greedy tokens must not flip on a bf16 rounding
    return build_runner(WorkerConfig(device="cuda", dtype="float32", kv_cache_memory="64MiB",
                                    max_model_len=512, max_num_seqs=8, overlap_steps="on",
                                    enforce_eager=enforce_eager, kv_load_layer_groups=groups),
                       model_files)


def run(runner: ModelRunner, requests: list[tuple[str, list[int], list[int], int]],
        num_new_tokens: int, kv_loads=(), kv_stores=(), load_alone: bool = False,
        hold_load: bool = False) -> dict[str, list[int]]:
    """Requests (id, prompt, block ids, computed tokens) admitted together: their prompts in
    one step (with the loads, or after a step of loads alone), then greedy decode steps,
    each queued before the last is read back. ``hold_load``: the load stream is held back
    first, so a forward that did not wait would surely read the blocks before they land."""
    sampling = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True)
    new = [NewRequestData(request_id, token_ids, sampling, block_ids, num_computed)
           for request_id, token_ids, block_ids, num_computed in requests]
    prompt = [ScheduledRequest(request_id, len(token_ids) - num_computed)
              for request_id, token_ids, _, num_computed in requests]
    plans = [StepPlan(0, new, [], kv_loads=list(kv_loads))] if load_alone else []
    plans.append(StepPlan(len(plans), [] if load_alone else new, prompt,
                          kv_loads=[] if load_alone else list(kv_loads),
                          kv_stores=list(kv_stores)))
    first = len(plans)
    plans += [StepPlan(step_id, [], [ScheduledRequest(r[0], 1) for r in requests])
              for step_id in range(first, first + num_new_tokens - 1)]
    if hold_load:
        with torch.cuda.stream(runner.kv.offload.tiers._load_stream):
            torch.cuda._sleep(HOLD_CYCLES)
    outputs: dict[str, list[int]] = {r[0]: [] for r in requests}
    for result in [r for plan in plans for r in runner.submit(plan)] + runner.flush():
        for request_id, token in zip(result.request_ids, result.sampled_token_ids):
            outputs[request_id].append(token)
    return outputs


@pytest.fixture(scope="module")
def stored(six_layers, tmp_path_factory):
    """A prompt's first 4 blocks stored in an arena, and the uncached greedy tokens of that
    prompt ("r") and of another sharing those 64 tokens ("s")."""
    shm = Path("/dev/shm")
    arena_dir = Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    gen = torch.Generator().manual_seed(0)
    prompt_r = torch.randint(5, 40_000, (70,), generator=gen).tolist()
    prompt_s = prompt_r[:64] + torch.randint(5, 40_000, (10,), generator=gen).tolist()
    writer = make_runner(six_layers)
    offload = offload_to_new_arena(writer, arena_dir / "arena")
    expected = run(writer, [("r", prompt_r, list(range(6)), 0)], 12, kv_stores=[
        KvStoreRun("r", 0, [0, 1, 2, 3], [b"0", b"1", b"2", b"3"])])
    expected |= run(writer, [("s", prompt_s, list(range(10, 16)), 0)], 12)
    while offload.poll():
        pass
    (commit,) = offload.take_commits()
    writer.attach_kv(None)
    yield arena_dir / "arena", commit.slot_ids, prompt_r, prompt_s, expected
    shutil.rmtree(arena_dir)


@pytest.mark.parametrize("load_alone", [False, True])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_four_groups_give_the_greedy_tokens_of_one_and_of_no_load(six_layers, stored,
                                                                  enforce_eager, load_alone):
    """Piecewise graphs (enforce_eager False: the 16-token prompt step) or eager; "s" reads
    the blocks "r" loads in the same step (the scheduler makes them findable at once)."""
    path, slot_ids, prompt_r, prompt_s, expected = stored
    loaded = [40, 12, 33, 7]
    requests = [("r", prompt_r, loaded + [8, 9], 64), ("s", prompt_s, loaded + [20, 21], 64)]
    outputs = {}
    for groups in (1, 4):
        reader = make_runner(six_layers, enforce_eager, groups)
        reader.attach_kv(KvOffload(KvTiers(reader.kv_cache, KvArena.attach(path),
                                           num_load_groups=groups), "store-1", reader.block_size))
        tiers = reader.kv.offload.tiers
        # The process's first loads once blocked the host until the held stream ran (~50 ms,
        # the hold: on an H200 only in the module's first case, both runners), so the load
        # was done before the forward asked and nothing was waited for; one unheld load of
        # the same blocks first, so the case measures the step's ordering, not that.
        tiers.load(slot_ids, loaded)
        torch.cuda.synchronize()
        tiers.wait_for_loads(loaded)  # (done: forgotten)
        per_layer_waits = []
        wait_for_loads = tiers.wait_for_loads

        def spy(*args, **kwargs):
            per_layer_waits.append(wait_for_loads(*args, **kwargs))
            return per_layer_waits[-1]
        tiers.wait_for_loads = spy
        outputs[groups] = run(reader, requests, 12, kv_loads=[KvLoad(slot_ids, loaded)],
                              load_alone=load_alone, hold_load=True)
        # The prompt step waited per layer with 4 groups, for the whole load with 1. A load
        # in a step of its own is read by a later step: one group, a whole wait (the
        # connector groups only a load its own step's forward reads).
        waited_per_layer = any(w is not None for w in per_layer_waits)
        assert waited_per_layer == (groups > 1 and not load_alone), per_layer_waits
        reader.attach_kv(None)
    assert outputs[4] == outputs[1] == expected
