"""Loads in layer groups on CPU (kv_load_groups.py): the group split; the chunks issued (one
group: exactly the chunks of an ungrouped load); KvTiers' 2D copies of a group (memmove on
the real pointers standing in for cudaMemcpy2DAsync), scattered by the Triton kernel
(interpreter), give the blocks a plain load gives; which loads a step waits for whole and
which per layer; and the waits reach the eager model, the piecewise pieces and the runner's
forward before each layer's attention. The device side: test_kv_load_groups_gpu.py."""

from __future__ import annotations

import ctypes
import random
import types

import pytest
import torch

from kernels.kv_blocks import scatter_blocks
from kernels.paged_attention_ref import allocate_kv_cache
from kernels.rotary import build_cos_sin_cache
from services.worker import cuda_graphs, model as model_module
from services.worker.cuda_graphs import PiecewiseGraphs
from services.worker.kv_load_groups import (
    Copy2D, LoadCopy, group_chunk_blocks, group_copies, layer_groups, load_chunks, load_waits,
)
from services.worker.kv_tiers import KvTiers, chunked_runs
from services.worker.model import ModelConfig, Transformer, compute_inv_freq
from services.worker.weights import random_weights
from services.worker.runner import SequenceChunk, build_step_inputs
from services.worker.runner_build import build_runner
from shared.kv_arena import KvArena


def test_layers_split_into_even_groups_in_order():
    assert layer_groups(32, 1) == [(0, 32)]
    assert layer_groups(32, 4) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert layer_groups(5, 2) == [(0, 2), (2, 5)]
    assert layer_groups(6, 4) == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert layer_groups(3, 8) == [(0, 1), (1, 2), (2, 3)]  # at most one group a layer
    with pytest.raises(ValueError):
        layer_groups(4, 0)


def ungrouped_chunks(slot_ids: list[int], chunk: int) -> list[tuple]:
    """What KvTiers.load issued before groups: (buffer, first, num_blocks, runs) per chunk."""
    return [(number % 2, first, min(chunk, len(slot_ids) - first), runs)
            for number, (first, runs) in enumerate(zip(range(0, len(slot_ids), chunk),
                                                       chunked_runs(slot_ids, chunk)))]


@pytest.mark.parametrize("seed", range(4))
def test_one_group_issues_the_chunks_of_an_ungrouped_load(seed):
    rng = random.Random(seed)
    slot_ids = list(range(40, 40 + rng.randint(1, 30))) + rng.sample(range(200), rng.randint(0, 40))
    chunk = rng.choice([1, 3, 16, 100])
    chunks = load_chunks(chunked_runs(slot_ids, chunk), chunk, len(slot_ids), 1)
    assert [(c.buffer, c.first, c.num_blocks, c.slot_runs) for c in chunks] == \
        ungrouped_chunks(slot_ids, chunk)
    assert {c.group for c in chunks} == {0}


def test_groups_go_one_after_the_other_and_buffers_alternate_across_them():
    slot_ids = list(range(10))
    chunks = load_chunks(chunked_runs(slot_ids, 4), 4, 10, 3)
    assert [(c.group, c.first, c.num_blocks, c.buffer) for c in chunks] == [
        (0, 0, 4, 0), (0, 4, 4, 1), (0, 8, 2, 0),
        (1, 0, 4, 1), (1, 4, 4, 0), (1, 8, 2, 1),
        (2, 0, 4, 0), (2, 4, 4, 1), (2, 8, 2, 0)]
    assert chunks[5].slot_runs == [(0, 8, 2)]


def test_a_groups_copy_is_its_bytes_of_each_slot_of_a_run():
    # 4 layers of 100 bytes: slots of 400; layers [1, 3) of slots 7, 8, 9 into rows 2..4
    assert group_copies([(2, 7, 3), (0, 20, 1)], (1, 3), 100, 400) == [
        Copy2D(dst_offset=400, dst_pitch=200, src_offset=7 * 400 + 100, src_pitch=400,
               width=200, height=3),
        Copy2D(dst_offset=0, dst_pitch=200, src_offset=20 * 400 + 100, src_pitch=400,
               width=200, height=1)]


NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 40, 4, 2, 8


def memmove_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
               stream: int) -> None:
    """cudaMemcpy2DAsync's stand-in on host pointers."""
    assert width <= dst_pitch and width <= src_pitch and stream == 7
    for row in range(height):
        ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)


def grouped_load(tiers: KvTiers, slot_ids: list[int], block_ids: list[int], num_groups: int,
                 staging_blocks: int) -> None:
    """KvTiers.load's grouped path on CPU: its chunks, its ``_copy_group`` (the 2D copies
    by memmove on the real pointers) into two staging buffers, the layer-range scatter."""
    tiers.load_groups = layer_groups(NUM_LAYERS, num_groups)
    tiers._memcpy_2d = memmove_2d
    tiers._load_staging = [torch.full((staging_blocks, *tiers.slot_shape), float("nan"),
                                      dtype=tiers.kv_cache.dtype) for _ in range(2)]
    chunk = group_chunk_blocks(staging_blocks, tiers.load_groups)
    ids = torch.tensor(block_ids)
    for part in load_chunks(chunked_runs(slot_ids, chunk), chunk, len(slot_ids),
                            len(tiers.load_groups)):
        staging = tiers._copy_group(part, types.SimpleNamespace(cuda_stream=7))
        assert staging.data_ptr() == tiers._load_staging[part.buffer].data_ptr()
        scatter_blocks(tiers.kv_cache, ids[part.first:part.first + part.num_blocks], staging,
                       layers=tiers.load_groups[part.group])


def test_a_staging_buffer_holds_a_chunk_of_the_largest_group():
    assert group_chunk_blocks(16, [(0, 32)]) == 16
    assert group_chunk_blocks(16, layer_groups(32, 4)) == 64
    assert group_chunk_blocks(3, layer_groups(6, 4)) == 9  # groups of 1 and 2 layers


@pytest.mark.parametrize("num_groups", [2, 4, 6])
@pytest.mark.parametrize("slots_kind", ["consecutive", "random"])
def test_a_grouped_load_gives_the_blocks_a_plain_load_gives(tmp_path, num_groups, slots_kind):
    rng = random.Random(num_groups)
    slot_nbytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    arena = KvArena.create(tmp_path / "arena", 30, slot_nbytes, "store-1")
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = allocate_kv_cache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                              torch.bfloat16, torch.device("cpu"))
    tiers = KvTiers(cache, arena)
    tiers.slots.copy_(torch.randn(tiers.slots.shape, generator=torch.Generator().manual_seed(1)))
    slot_ids = list(range(3, 26)) if slots_kind == "consecutive" else rng.sample(range(30), 23)
    block_ids = rng.sample(range(NUM_BLOCKS), 23)
    expected = cache.clone()
    expected.permute(2, 0, 1, 3, 4, 5)[block_ids] = tiers.slots[slot_ids]
    grouped_load(tiers, slot_ids, block_ids, num_groups, staging_blocks=3)
    assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))
    tiers.close()


def test_a_load_copies_each_block_once_per_group_and_once_when_not_grouped(tmp_path):
    """An ungrouped load on a worker with G groups copies every block once, all its layers
    (it was issued once per group: G times the bytes, 2.6-5x slower prefill512 hits)."""
    slot_nbytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2
    arena = KvArena.create(tmp_path / "arena", 30, slot_nbytes, "store-1")
    cache = allocate_kv_cache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                              torch.bfloat16, torch.device("cpu"))
    tiers = KvTiers(cache, arena)
    tiers.load_groups = layer_groups(NUM_LAYERS, 3)
    tiers.staging_blocks = 4
    tiers.group_staging_blocks = group_chunk_blocks(4, tiers.load_groups)
    slot_ids = random.Random(3).sample(range(30), 23)

    def copies(grouped: bool) -> list[tuple[int, int]]:  # (group, slot) of each block copied
        return sorted((part.group, slot_id + offset) for part in tiers.load_chunks(slot_ids, grouped)
                      for _, slot_id, length in part.slot_runs for offset in range(length))

    assert copies(False) == [(0, slot_id) for slot_id in sorted(slot_ids)]
    assert copies(True) == [(group, slot_id) for group in range(3) for slot_id in sorted(slot_ids)]
    tiers.close()


class Event:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def grouped(block_ids, name: str, groups_of_layers=(0, 0, 1, 1, 1, 2)) -> LoadCopy:
    num_groups = max(groups_of_layers) + 1
    return LoadCopy(frozenset(block_ids), Event(f"{name}.done"),
                    tuple(Event(f"{name}.{g}") for g in range(num_groups)), groups_of_layers)


def names(per_layer):
    return None if per_layer is None else [[e.name for e in events] for events in per_layer]


def test_a_step_reading_a_grouped_load_waits_per_layer_at_each_groups_first_layer():
    whole, per_layer = load_waits([grouped({1, 2, 3}, "a")], {2, 9}, {9}, 6, by_layer=True)
    assert whole == []
    assert names(per_layer) == [["a.0"], [], ["a.1"], [], [], ["a.2"]]


def test_whole_loads_are_waited_for_where_per_layer_waits_cannot_serve():
    a, b = grouped({1, 2}, "a"), grouped({5}, "b")
    # a decode graph (no per-layer waits): the whole load
    assert [e.name for e in load_waits([a], {1}, set(), 6, by_layer=False)[0]] == ["a.done"]
    # the step writes a loading block (its K/V goes in before the layer's attention)
    whole, per_layer = load_waits([a, b], {1, 5}, {5}, 6, by_layer=True)
    assert [e.name for e in whole] == ["b.done"] and names(per_layer)[0] == ["a.0"]
    # an ungrouped load
    plain = LoadCopy(frozenset({7}), Event("c.done"))
    assert [e.name for e in load_waits([plain], {7}, set(), 6, by_layer=True)[0]] == ["c.done"]
    # loads of other blocks: nothing
    assert load_waits([a, b, plain], {30}, {30}, 6, by_layer=True) == ([], None)


def test_two_loads_read_by_one_step_add_up_per_layer():
    a, b = grouped({1}, "a"), grouped({2}, "b", groups_of_layers=(0, 0, 0, 1, 1, 1))
    _, per_layer = load_waits([a, b], {1, 2}, set(), 6, by_layer=True)
    assert names(per_layer) == [["a.0", "b.0"], [], ["a.1"], ["b.1"], [], ["a.2"]]


CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64,
              intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def tiny_model() -> Transformer:
    config = ModelConfig.from_dict(CONFIG)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(random_weights(model, torch.device("cpu"), torch.float32, seed=3),
                          strict=True, assign=True)
    model.inv_freq = compute_inv_freq(config)
    model.cos_sin_cache = build_cos_sin_cache(model.inv_freq, config.max_position_embeddings)
    model.bind_kv_cache(allocate_kv_cache(3, 8, 4, 2, 16, torch.float32, "cpu"))
    return model.eval()


@pytest.mark.parametrize("mode", ["eager", "pieces"])
@torch.inference_mode()
def test_each_layers_waits_come_right_before_its_attention(monkeypatch, mode):
    model = tiny_model()
    calls = []
    monkeypatch.setattr(model_module, "wait_events", lambda events: calls.append(list(events)))
    monkeypatch.setattr(cuda_graphs, "wait_events", lambda events: calls.append(list(events)))
    for index, layer in enumerate(model.layers):
        attend = layer.self_attn.attend

        def recorded(*args, index=index, attend=attend, **kwargs):
            calls.append(f"attend {index}")
            return attend(*args, **kwargs)
        layer.self_attn.attend = recorded
    chunks = [SequenceChunk(token_ids=[5, 6, 7, 8, 9], start=0, block_table=[3, 1], sample=True)]
    input_ids, positions, metadata = build_step_inputs(chunks, 4, torch.device("cpu"))
    run = model if mode == "eager" else PiecewiseGraphs(model, 16, torch.device("cpu"),
                                                        use_graphs=False).run
    expected = run(input_ids, positions, metadata)
    calls.clear()
    logits = run(input_ids, positions, metadata, [["e0"], [], ["e2a", "e2b"]])
    waits = [call for call in calls if call != []]  # the eager layers' empty waits
    assert waits == [["e0"], "attend 0", "attend 1", ["e2a", "e2b"], "attend 2"]
    torch.testing.assert_close(logits, expected)
    calls.clear()
    run(input_ids, positions, metadata)  # no waits: none called
    assert [call for call in calls if call != []] == ["attend 0", "attend 1", "attend 2"]


class FakeTiers:
    """Loads pending on 'the device': records what the runner asks to wait for."""

    has_pending = False  # no stores

    def __init__(self) -> None:
        self.pending_loads = ["a load"]
        self.asked = []

    def wait_for_loads(self, block_ids, written_block_ids, by_layer):
        self.asked.append((sorted(set(block_ids)), sorted(written_block_ids), by_layer))
        return [["group 0"], []] if by_layer else None


class FakeOffload:
    def __init__(self) -> None:
        self.tiers = FakeTiers()

    def end_submit(self) -> None:
        pass


class FakeDecodeGraphs:
    """Takes every decode-shaped step (as the real ones would), run eagerly."""

    query_len = 1  # one query a sequence

    def __init__(self, model) -> None:
        self.model, self.num_runs = model, 0

    def bucket_for(self, num_seqs: int) -> int:
        return num_seqs

    def runs(self, num_tokens, num_seqs, max_query_len, num_logits, lora=False) -> bool:
        return max_query_len == 1 and num_tokens == num_seqs == num_logits and not lora

    def run(self, input_ids, positions, metadata, pending=None, lora=False):
        assert pending is None and not lora  # (no step in flight on the CPU; no adapters)
        self.num_runs += 1
        return self.model(input_ids, positions, metadata)




def test_the_runner_hands_per_layer_waits_to_the_forward_except_to_a_decode_graph(
        dummy_model, monkeypatch):
    from services.worker.config import WorkerConfig
    from services.worker.runner_build import build_runner
    from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan

    runner = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                      kv_load_layer_groups=2), dummy_model)
    offload = FakeOffload()
    runner.attach_kv(offload)
    waited = []  # the non-empty waits (the eager layers call it with none too)
    monkeypatch.setattr(model_module, "wait_events",
                        lambda events: waited.append(list(events)) if events else None)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # blocks 4 (loading: computed as far as the scheduler knows) and 9 (this step's tokens)
    new = NewRequestData("r", list(range(100, 120)), greedy, [4, 9], 16)
    runner.execute(StepPlan(0, [new], [ScheduledRequest("r", 4)]))
    assert offload.tiers.asked == [([4, 9], [9], True)]
    assert waited == [["group 0"]]  # layer 0's attention waits; layer 1 has nothing more
    runner._graphs = FakeDecodeGraphs(runner.model)
    waited.clear()
    runner.execute(StepPlan(1, [], [ScheduledRequest("r", 1)]))
    assert offload.tiers.asked[1] == ([4, 9], [9], False)  # a decode graph: the whole load
    assert runner._graphs.num_runs == 1 and waited == []
    offload.tiers.pending_loads = []
    runner.execute(StepPlan(2, [], [ScheduledRequest("r", 1)]))
    assert len(offload.tiers.asked) == 2  # nothing loading: nothing asked


class RecordingOffload(FakeOffload):
    """Records how each plan's loads were asked for (nothing is copied)."""

    store_id = "store"

    def __init__(self) -> None:
        super().__init__()
        self.tiers.pending_loads = []
        self.tiers.arena_is_current = lambda: True
        self.loads = []

    def load(self, loads, *, in_layer_groups):
        self.loads.append(([b for load in loads for b in load.block_ids], in_layer_groups))

    def resolve_stores(self, runs, lookup):
        return []


def test_a_load_goes_in_layer_groups_only_when_this_steps_forward_reads_it(dummy_model):
    from services.worker.config import WorkerConfig
    from services.worker.runner_build import build_runner
    from shared.messages import KvLoad, NewRequestData, SamplingParams, ScheduledRequest, StepPlan

    runner = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                      kv_load_layer_groups=2), dummy_model)
    offload = RecordingOffload()
    runner.attach_kv(offload)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # "a" computes 4 tokens after its loaded block 4 in this step: the forward reads it
    new_a = NewRequestData("a", list(range(100, 120)), greedy, [4, 9], 16)
    runner.execute(StepPlan(0, [new_a], [ScheduledRequest("a", 4)],
                            kv_loads=[KvLoad([0], [4], "store")]))
    # "b" runs a prompt of its own beside "c", which only loads block 6 in this step (it
    # computes from a later one)
    new_b = NewRequestData("b", list(range(200, 210)), greedy, [7], 0)
    new_c = NewRequestData("c", list(range(300, 320)), greedy, [6, 8], 16)
    runner.execute(StepPlan(1, [new_b, new_c], [ScheduledRequest("b", 10)],
                            kv_loads=[KvLoad([1], [6], "store")]))
    assert offload.loads == [([4], True), ([6], False)]


def test_loads_go_in_eight_layer_groups_by_default_at_most_one_a_layer(monkeypatch):
    """The default (8, measured on an H200) is clamped to the layers; CPU, a worker without
    a kvstore, and a 2D copy that cannot be bound or copies wrong all load in one group."""
    from services.worker import kv_connector
    from services.worker.config import WorkerConfig
    from services.worker.kv_connector import usable_load_groups

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with_kv = WorkerConfig(kv_node_id="node-a")
    assert with_kv.kv_load_layer_groups == 8
    checked = []
    monkeypatch.setattr(kv_connector, "check_memcpy_2d", checked.append)
    assert usable_load_groups(with_kv, 32, cuda) == 8 and checked == [cuda]
    assert usable_load_groups(with_kv, 2, cuda) == 2  # at most one group a layer
    assert usable_load_groups(with_kv, 32, cpu) == 1  # a load is a plain copy on CPU
    assert usable_load_groups(WorkerConfig(), 32, cuda) == 1  # no kvstore: nothing loads
    assert usable_load_groups(WorkerConfig(kv_node_id="n", kv_load_layer_groups=1), 32,
                              cuda) == 1
    assert len(checked) == 2

    def unbound(device):
        raise RuntimeError("cudaMemcpy2DAsync could not be bound")
    monkeypatch.setattr(kv_connector, "check_memcpy_2d", unbound)
    assert usable_load_groups(with_kv, 32, cuda) == 1
