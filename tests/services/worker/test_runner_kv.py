"""The runner with a kvstore arena on CPU: a plan's stores commit the right blocks and token
ids (also with overlapped steps, and for a request that finished before its commit), and
blocks loaded into other block ids of a fresh runner continue a prompt with the greedy tokens
of an uncached run (through the CPU decode contexts too)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.config import WorkerConfig
from services.worker.kv_connector import KvConnector, NoKvConnector
from services.worker.kv_offload import KvOffload, recompute_unusable_loads
from services.worker.kv_tiers import KvTiers
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from shared.kv_arena import KvArena
from shared.messages import (
    KvLoad, KvStoreRun, NewRequestData, SamplingParams, ScheduledRequest, StepPlan,
)
from shared.models import ModelFiles
from tests.services.worker.kv_arenas import committed_blocks

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None)
BLOCK_SIZE = 16
NUM_SLOTS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> ModelFiles:
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model.save_pretrained(path, safe_serialization=True)
    return ModelFiles(name="tiny-llama", path=path)


def make_runner(model_files: ModelFiles, overlap: bool = False) -> ModelRunner:
    runner = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                      block_size=BLOCK_SIZE), model_files)
    runner.overlap_steps = overlap
    return runner


def attach(runner: ModelRunner, arena_path) -> KvOffload:
    offload = KvOffload(KvTiers(runner.kv_cache, KvArena.attach(arena_path)), "store-1",
                        BLOCK_SIZE)
    runner.attach_kv(offload)
    return offload


@pytest.fixture
def arena_path(tmp_path):
    slot_nbytes = TINY["num_hidden_layers"] * 2 * BLOCK_SIZE * TINY["num_key_value_heads"] \
        * (TINY["hidden_size"] // TINY["num_attention_heads"]) * 4
    KvArena.create(tmp_path / "arena", NUM_SLOTS, slot_nbytes, "store-1").close()
    return tmp_path / "arena"


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """A scheduler in miniature for one runner: whole prompts, then one token per step, counting
    a sampled token as pending until its step is read back (as the real one does), and a store
    of every block that a step completes, in that step's plan."""

    def __init__(self, runner: ModelRunner, store: bool = True) -> None:
        self.runner, self.store = runner, store
        self.step_id = 0
        self.free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self.tokens: dict[str, list[int]] = {}  # read back
        self.num_tokens: dict[str, int] = {}  # with the pending one
        self.num_computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_stored: dict[str, int] = {}
        self.new: dict[str, NewRequestData] = {}

    def add(self, request_id: str, token_ids: list[int], num_computed: int = 0,
            block_ids: list[int] | None = None) -> None:
        block_ids = block_ids or []
        for block_id in block_ids:
            self.free_blocks.remove(block_id)
        self.tokens[request_id], self.num_tokens[request_id] = list(token_ids), len(token_ids)
        self.num_computed[request_id], self.block_ids[request_id] = num_computed, list(block_ids)
        self.num_stored[request_id] = num_computed // BLOCK_SIZE  # loaded: not stored again
        self.new[request_id] = NewRequestData(request_id, list(token_ids), GREEDY,
                                              list(block_ids), num_computed)

    def step(self, finished: list[str] = (), kv_loads: list[KvLoad] = (),
             extra_stores: list[KvStoreRun] = ()) -> None:
        scheduled, stores = [], list(extra_stores)
        for request_id in finished:
            for table in (self.tokens, self.num_tokens, self.num_computed, self.block_ids):
                table.pop(request_id)
        for request_id, num_computed in self.num_computed.items():
            num_new = self.num_tokens[request_id] - num_computed
            num_needed = -(-(num_computed + num_new) // BLOCK_SIZE)
            new_block_ids = [self.free_blocks.pop()
                             for _ in range(num_needed - len(self.block_ids[request_id]))]
            if request_id in self.new:
                self.new[request_id] = self.new[request_id].__class__(
                    request_id, self.new[request_id].token_ids, GREEDY,
                    self.block_ids[request_id] + new_block_ids, num_computed)
                scheduled.append(ScheduledRequest(request_id, num_new))
            else:
                scheduled.append(ScheduledRequest(request_id, num_new, new_block_ids))
            self.block_ids[request_id] += new_block_ids
            self.num_computed[request_id] += num_new
            self.num_tokens[request_id] += 1  # every step here samples
            num_full = self.num_computed[request_id] // BLOCK_SIZE
            first = self.num_stored[request_id]
            if self.store and num_full > first:
                block_ids = self.block_ids[request_id][first:num_full]
                stores.append(KvStoreRun(request_id, first, block_ids,
                                         [f"{request_id}/{i}".encode()
                                          for i in range(first, num_full)]))
                self.num_stored[request_id] = num_full
        plan = StepPlan(self.step_id, list(self.new.values()), scheduled, list(finished),
                        kv_loads=list(kv_loads), kv_stores=stores)
        self.new.clear()
        self.step_id += 1
        self.read(self.runner.submit(plan))

    def read(self, results) -> None:
        for result in results:
            for request_id, token_id in zip(result.request_ids, result.sampled_token_ids):
                if request_id in self.tokens:
                    self.tokens[request_id].append(token_id)

    def flush(self) -> None:
        self.read(self.runner.flush())


def committed(offload: KvOffload) -> dict[bytes, tuple[int, list[int]]]:
    return {block_hash: (slot_id, token_ids) for commit in offload.take_commits()
            for block_hash, slot_id, token_ids in committed_blocks(commit)}


@pytest.mark.parametrize("overlap", [False, True])
def test_commits_carry_each_blocks_tokens_with_overlapped_steps(tiny_model, arena_path,
                                                                 overlap):
    """Blocks completed by a step whose last token the step in flight sampled (overlap: not on
    the host when the plan was submitted), and the last blocks of a request stored in the plan
    that finishes it, commit the tokens the request really has; the slots hold the blocks."""
    runner = make_runner(tiny_model, overlap)
    offload = attach(runner, arena_path)
    offload.slot_pool.add(range(NUM_SLOTS))
    driver = Driver(runner)
    driver.add("a", prompt(21, 1))
    driver.add("b", prompt(7, 2))
    commits: dict[bytes, tuple[int, list[int]]] = {}
    for _ in range(30):
        driver.step()
        commits |= committed(offload)
    assert runner.num_overlapped_steps > 0 if overlap else runner.num_overlapped_steps == 0
    # "a" ends here; its latest block is stored in the plan that finishes it
    tokens_a, block_ids_a = list(driver.tokens["a"]), list(driver.block_ids["a"])
    num_full_a = driver.num_computed["a"] // BLOCK_SIZE
    driver.step(finished=["a"], extra_stores=[KvStoreRun(
        "a", num_full_a - 1, [block_ids_a[num_full_a - 1]], [b"a/last"])])
    driver.flush()
    commits |= committed(offload)
    tokens = {"a": tokens_a, "b": driver.tokens["b"]}
    assert len(commits) >= 6
    cache = runner.kv_cache  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    slots = offload.tiers.slots
    for block_hash, (slot_id, token_ids) in commits.items():
        request_id, index = block_hash.decode().split("/")
        index = num_full_a - 1 if index == "last" else int(index)
        assert token_ids == tokens[request_id][index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]
        block_id = (block_ids_a if request_id == "a" else driver.block_ids["b"])[index]
        assert torch.equal(slots[slot_id], cache[:, :, block_id])
    assert offload.num_skipped == 0


def generate(runner: ModelRunner, token_ids: list[int], num_new_tokens: int,
             num_loaded: int = 0, slot_ids: list[int] = (), block_ids: list[int] = (),
             store_id: str = "", load_alone: bool = False) -> list[int]:
    """``load_alone``: the loads come in a step of their own that computes nothing of the
    request (as the scheduler plans them); else in its first computing step."""
    driver = Driver(runner, store=False)
    driver.add("r", token_ids, num_loaded, list(block_ids))
    kv_loads = [KvLoad(list(slot_ids), list(block_ids), store_id)] if slot_ids else []
    if load_alone and kv_loads:
        driver.read(runner.submit(StepPlan(driver.step_id, [driver.new.pop("r")], [],
                                           kv_loads=kv_loads)))
        driver.step_id += 1
        kv_loads = []
    driver.step(kv_loads=kv_loads)
    while len(driver.tokens["r"]) < len(token_ids) + num_new_tokens:
        driver.step()
    driver.flush()
    return driver.tokens["r"][len(token_ids):len(token_ids) + num_new_tokens]


@pytest.mark.parametrize("load_alone", [False, True])
@pytest.mark.parametrize("num_prompt_tokens", [40, 33])
def test_blocks_loaded_into_a_fresh_runner_continue_with_the_same_greedy_tokens(
        tiny_model, arena_path, num_prompt_tokens, load_alone):
    """Store a prompt's full blocks, load them into other block ids of a fresh runner and
    compute only the rest: the same greedy tokens as computing it all. With 33 tokens the
    first step computes one token, so it runs through the CPU decode context, which has just
    held another sequence on the very blocks loaded into (it must not trust that copy)."""
    tokens = prompt(num_prompt_tokens, 3)
    expected = generate(make_runner(tiny_model), tokens, 12)

    writer = make_runner(tiny_model)
    offload = attach(writer, arena_path)
    offload.slot_pool.add([9, 10, 4])
    driver = Driver(writer)
    driver.add("r", tokens)
    driver.step()
    commits = committed(offload)
    assert sorted(commits) == [b"r/0", b"r/1"]
    slot_ids = [commits[b"r/0"][0], commits[b"r/1"][0]]

    reader = make_runner(tiny_model)
    attach(reader, arena_path)
    block_ids = [5, 9]
    # another sequence decodes on blocks 5, 9 at length 32 just before the load
    other = Driver(reader, store=False)
    other.add("other", prompt(31, 4), block_ids=[5, 9])
    other.step()
    other.step()
    assert other.num_computed["other"] == 32
    reader.submit(StepPlan(other.step_id, [], [], ["other"]))
    loaded = generate(reader, tokens, 12, num_loaded=32, slot_ids=slot_ids,
                      block_ids=block_ids, load_alone=load_alone)
    assert loaded == expected


@pytest.mark.parametrize("load_alone", [False, True])
@pytest.mark.parametrize("case", ["no arena", "another kvstore's slots"])
def test_a_load_the_worker_cannot_make_is_computed_instead(tiny_model, arena_path, case,
                                                          load_alone):
    """Without an arena, or with slots pinned by another kvstore process than the one
    attached (it restarted; the worker has not re-attached yet), the request computes the
    blocks it was to load in this step: the uncached greedy tokens, no failed step."""
    tokens = prompt(40, 5)
    expected = generate(make_runner(tiny_model), tokens, 6)
    runner = make_runner(tiny_model)
    offload = attach(runner, arena_path) if case != "no arena" else None
    # garbage in the blocks (and zeros in the slots): using either changes the tokens
    runner.kv_cache[:, :, 4:6] = 10 * torch.randn_like(runner.kv_cache[:, :, 4:6])
    loaded = generate(runner, tokens, 6, num_loaded=32, slot_ids=[3, 2], block_ids=[4, 5],
                      store_id="store-0", load_alone=load_alone)
    assert loaded == expected
    if offload is not None:
        assert offload.num_recomputed == 2 and offload.num_loaded == 0


def test_a_load_reports_its_bytes_and_speed(tiny_model, arena_path):
    runner = make_runner(tiny_model)
    offload = attach(runner, arena_path)
    plan = StepPlan(0, [NewRequestData("r", prompt(20, 5), GREEDY, [3, 4], 16)],
                    [ScheduledRequest("r", 4)], kv_loads=[KvLoad([7], [3])])
    result = runner.execute(plan)
    assert result.kv_load_bytes == offload.tiers.slot_nbytes
    assert result.kv_load_bytes_per_s > 0


def test_a_request_only_loading_computes_its_unusable_blocks_in_that_step():
    """The scheduler plans a loading request's compute for a later step; when the worker
    cannot load, it computes those blocks in the loading step itself, ending where the
    scheduler takes the request to start (so the next step's chunk follows on)."""
    plan = StepPlan(3, [NewRequestData("r", prompt(40, 5), GREEDY, [4, 5, 6], 32),
                        NewRequestData("s", prompt(20, 6), GREEDY, [7, 8], 0)],
                    [ScheduledRequest("d", 1), ScheduledRequest("s", 20)],
                    kv_loads=[KvLoad([3, 2], [4, 5], "store-0")])
    fixed, num_blocks = recompute_unusable_loads(plan, None, BLOCK_SIZE)
    assert num_blocks == 2 and fixed.kv_loads == []
    assert fixed.new_requests[0].num_computed_tokens == 0
    assert [(s.request_id, s.num_new_tokens) for s in fixed.scheduled] == [
        ("d", 1), ("s", 20), ("r", 32)]


def test_the_runner_meets_the_kvstore_through_its_connector(tiny_model, arena_path):
    """No kvstore: the null connector, whose only work is computing loads instead. Attached:
    a KvConnector over the offload; detached again: the null one, and the offload's arena
    is unmapped."""
    runner = make_runner(tiny_model)
    assert type(runner.kv) is NoKvConnector and runner.kv.offload is None
    assert runner.kv_load_groups == 1  # the default of 8 layer groups: one on CPU
    offload = attach(runner, arena_path)
    assert type(runner.kv) is KvConnector and runner.kv.offload is offload
    runner.attach_kv(None)
    assert type(runner.kv) is NoKvConnector and offload.tiers.slots is None
