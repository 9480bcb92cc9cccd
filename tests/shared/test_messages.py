"""Every wire message survives encode -> decode unchanged, and old peers keep working."""

from __future__ import annotations

import msgspec
import pytest

from shared import messages as m
from shared import kv_messages as km
from shared import scheduler_stats as ss

STRUCTURED = m.StructuredSpec(kind="json_schema", json_schema='{"type": "object"}')
SAMPLING = m.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3,
                            stop_token_ids=[2], ignore_eos=True, min_p=0.1, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={7: -100.0},
                            min_tokens=2, logprobs=3, prompt_logprobs=0, structured=STRUCTURED)
LOGPROBS = m.TokenLogprobs(5, -0.25, [5, 6], [-0.25, -1.5])
TOOL_CALL = m.ToolCall(id="call_1", function=m.FunctionCall(name="f", arguments='{"a": 1}'))
ERROR = m.ErrorInfo(status=503, message="worker gone", type="service_unavailable", code="x", param="p")

LAYOUT = km.KvLayout(weights_version="abc", dtype="bfloat16", num_layers=2, block_size=16,
                    num_kv_heads=2, head_dim=64)
TIER_STATS = km.KvTierStats(tier="host", num_blocks=1, num_bytes=128, capacity_bytes=512)
SNAPSHOT_PART = m.BlockSnapshotPart(namespace="ns", tier="host", block_hashes=[b"\x05" * 32])
STORE_RUN = m.KvStoreRun("r1", 2, [4, 5], [b"\x01" * 32, b"\x02" * 32])

ROUTING = ss.RoutingStats(block_size=16, model_name="x", kv_node_id="local", kv_namespace="ns",
                          num_queued_prefill_tokens=900, prefill_tokens_per_s=5e3,
                          host_load_bytes_per_s=1e9, disk_read_bytes_per_s=2e8,
                          block_bytes=1 << 16, block_event_seq=12)
ENGINE = ss.EngineStats(num_blocks_used=3, num_blocks_total=9, num_kv_tier_hits=32,
                        num_kv_tier_hits_by_tier={"host": 32}, recent_step_tokens=[7],
                        recent_step_times_s=[0.01])
SPECULATION = ss.SpeculationStats(num_draft_tokens=8, num_accepted_drafts=5,
                                  num_accepted_per_position=[3, 2], draft_cap=4)
MOE = ss.MoeStats(expert_token_counts=[[3, 0, 5, 1 << 40], [9, 0, 0, 0]])
LORA_REF = m.LoraRef(name="sql", path="/adapters/sql", content_hash="0123456789abcdef", rank=8)
BASE_SHAPES = m.BaseShapes(num_layers=2, part_shapes={"q_proj": [64, 64], "o_proj": [64, 64]},
                           max_rank=16)
LORA = ss.LoraStats(adapters=[LORA_REF], running=["sql"], waiting=[], max_loras=4)
SAMPLES: dict[type, object] = {
    m.ErrorInfo: ERROR,
    m.HealthReply: m.HealthReply(service="worker", instance_id="abc", detail={"num_blocks": 3, "ok": True}),
    m.Empty: m.Empty(),
    m.StructuredSpec: STRUCTURED,
    m.SamplingParams: SAMPLING,
    m.TokenLogprobs: LOGPROBS,
    m.FunctionCall: TOOL_CALL.function,
    m.ToolCall: TOOL_CALL,
    m.ChatMessage: m.ChatMessage(role="user", content="héllo 😀", name="bob"),
    m.EncodeRequest: m.EncodeRequest(messages=[
        m.ChatMessage(role="assistant", tool_calls=[TOOL_CALL]),
        m.ChatMessage(role="tool", content="1", tool_call_id="call_1")],
        add_generation_prompt=False, tools=[{"type": "function", "function": {"name": "f"}}]),
    m.EncodeReply: m.EncodeReply(token_ids=[1, 2, 3]),
    m.DecodeRequest: m.DecodeRequest(token_ids=[4, 5], skip_special_tokens=False),
    m.DecodeReply: m.DecodeReply(text="ok ✓"),
    m.GenerationDefaults: m.GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20,
                                               max_new_tokens=512),
    m.TokenizerInfo: m.TokenizerInfo(model_name="x", max_model_len=8192, vocab_size=10,
                                     eos_token_ids=[2], has_chat_template=True,
                                     generation_defaults=m.GenerationDefaults(temperature=0.7),
                                     document_start_token_id=1),
    m.GenerateRequest: m.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2], sampling=SAMPLING,
                                         output_subject="ns.v1.gateway.g.outputs", arrival_time=1.5,
                                         priority=-1, n=3, lora_name="sql"),
    m.SubmitReply: m.SubmitReply(scheduler_id="s1"),
    m.AbortRequest: m.AbortRequest(request_ids=["r1", "r2"]),
    m.RequestOutput: m.RequestOutput(request_id="r1", new_token_ids=[42], finish_reason="error",
                                     num_prompt_tokens=3, error=ERROR, num_cached_tokens=0,
                                     queue_time_s=0.0, logprobs=[LOGPROBS],
                                     prompt_logprobs=[None, LOGPROBS]),
    m.OutputBatch: m.OutputBatch([m.RequestOutput(request_id="r1", new_token_ids=[42]),
                                  m.RequestOutput(request_id="r2", new_token_ids=[],
                                                  finish_reason="abort")]),
    ss.RoutingStats: ROUTING,
    ss.EngineStats: ENGINE,
    ss.SpeculationStats: SPECULATION,
    ss.MoeStats: MOE,
    ss.SchedulerStats: ss.SchedulerStats(scheduler_id="s", replica_id="0", timestamp=1.0,
                                         num_running=2, num_waiting=1, num_steps=4,
                                         routing=ROUTING, engine=ENGINE, speculation=SPECULATION,
                                         moe=MOE, lora=LORA),
    ss.LoraStats: LORA,
    m.LoraRef: LORA_REF,
    m.BaseShapes: BASE_SHAPES,
    m.LoraLoadRequest: m.LoraLoadRequest(lora_name="sql", lora_path="/adapters/sql",
                                         replace=True),
    m.LoraUnloadRequest: m.LoraUnloadRequest(lora_name="sql"),
    m.LoraReply: m.LoraReply(adapters=[LORA_REF], timestamp=2.5),
    m.NewRequestData: m.NewRequestData("r1", [1, 2, 3], SAMPLING, [0, 1], 0, lora_name="sql",
                                       lora_path="/adapters/sql", lora_hash="0123456789abcdef"),
    m.ScheduledRequest: m.ScheduledRequest("r1", 1, [7]),
    m.StepPlan: m.StepPlan(3, [m.NewRequestData("r1", [1], SAMPLING, [0])],
                           [m.ScheduledRequest("r1", 1)], ["r0"], "w",
                           [m.KvLoad([1], [7], "store-1")], [STORE_RUN]),
    m.StepResult: m.StepResult(3, ["r1", "r2"], [99, 5], 0.01, [None, LOGPROBS], {"r1": [LOGPROBS]},
                               1 << 20, 2e9, [[4], []], 7, [[2, 0, 6], [1, 1, 6]]),
    m.WorkerInfo: m.WorkerInfo(worker_id="w", replica_id="0", model_name="x", num_blocks=10,
                               block_size=16, max_model_len=8192, eos_token_ids=[2],
                               kv_cache_bytes=1 << 20, device="cpu", dtype="float32",
                               kv_namespace="ns", kv_node_id="local", lora_base=BASE_SHAPES),
    km.KvLayout: LAYOUT,
    km.KvAttachRequest: km.KvAttachRequest(owner_id="w", layout=LAYOUT, itemsize=2),
    km.KvAttachReply: km.KvAttachReply(store_id="s", node_id="local", namespace="ns",
                                     arena_path="/dev/shm/a", num_slots=4, slot_nbytes=128),
    km.KvReserveRequest: km.KvReserveRequest(namespace="ns", owner_id="w", num_slots=3),
    km.KvReserveReply: km.KvReserveReply(store_id="s", slot_ids=[0, 2]),
    km.KvCommitRequest: km.KvCommitRequest(namespace="ns", owner_id="w", store_id="s",
                                         block_hashes=[b"\x01" * 32], slot_ids=[5],
                                         token_ids=list(range(16)), block_size=16,
                                         returned_slot_ids=[3]),
    km.KvLookupRequest: km.KvLookupRequest(namespace="ns", block_hashes=[b"\x01" * 32]),
    km.KvLookupReply: km.KvLookupReply(store_id="s", tiers=["host", "disk"],
                                     disk_read_bytes_per_s=1e9),
    km.KvPinRequest: km.KvPinRequest(namespace="ns", owner_id="sch", pin_id="p1",
                                   block_hashes=[b"\x01" * 32]),
    km.KvPinReply: km.KvPinReply(store_id="s", slot_ids=[1], token_ids=[[1, 2]], tiers=["disk"]),
    km.KvReleaseRequest: km.KvReleaseRequest(namespace="ns", owner_id="sch", pin_ids=["p1"]),
    km.KvKeepAlive: km.KvKeepAlive(owner_id="w"),
    km.KvBlockEvent: km.KvBlockEvent(store_id="s", node_id="local", namespace="ns", seq=4,
                                   tier="host", stored_hashes=[b"\x02" * 32], timestamp=1.0),
    m.SchedulerBlockEvent: m.SchedulerBlockEvent(scheduler_id="s1", replica_id="0", seq=2,
                                                 stored_hashes=[b"\x03" * 32],
                                                 removed_hashes=[b"\x04" * 32], timestamp=1.0),
    m.BlockSnapshotRequest: m.BlockSnapshotRequest(offset=16000, snapshot_seq=7),
    m.BlockSnapshotPart: SNAPSHOT_PART,
    m.BlockSnapshotReply: m.BlockSnapshotReply(source_id="s1", seq=7, num_hashes=1,
                                               parts=[SNAPSHOT_PART]),
    km.KvTierStats: TIER_STATS,
    km.KvStatsReply: km.KvStatsReply(store_id="s", node_id="local", tiers=[TIER_STATS]),
    m.KvLoad: m.KvLoad([1, 2], [7, 9], "store-1"),
    m.KvStoreRun: STORE_RUN,
}


def test_every_message_has_a_sample():
    assert set(SAMPLES) == set(m.ALL_MESSAGES)


@pytest.mark.parametrize("message_type", m.ALL_MESSAGES, ids=lambda t: t.__name__)
def test_round_trip(message_type):
    sample = SAMPLES[message_type]
    assert m.decode(m.encode(sample), message_type) == sample


@pytest.mark.parametrize("message_type", m.ALL_MESSAGES, ids=lambda t: t.__name__)
def test_messages_are_frozen(message_type):
    assert message_type.__struct_config__.frozen


def test_a_new_field_with_a_default_is_read_by_an_old_peer_and_vice_versa():
    class OutputV2(msgspec.Struct, array_like=True, frozen=True):
        request_id: str
        new_token_ids: list[int]
        finish_reason: str | None = None
        num_prompt_tokens: int = 0
        error: m.ErrorInfo | None = None
        num_cached_tokens: int = 0
        queue_time_s: float = 0.0
        logprobs: list[m.TokenLogprobs] = []
        prompt_logprobs: list[m.TokenLogprobs | None] = []
        future: list[float] = []

    new = OutputV2("r", [1], None, 2, None, 0, 0.0, [], [], [-0.5])
    assert m.decode(msgspec.msgpack.encode(new), m.RequestOutput) == m.RequestOutput(
        request_id="r", new_token_ids=[1], num_prompt_tokens=2)
    old = m.RequestOutput(request_id="r", new_token_ids=[1])
    assert msgspec.msgpack.decode(m.encode(old), type=OutputV2).future == []


def test_a_worker_or_scheduler_without_expert_counts_is_read_with_empty_ones():
    """Old senders (or a dense model's) carry no MoE routing: the fields take their defaults."""
    class StepResultV1(msgspec.Struct, array_like=True, frozen=True):  # before expert counts
        step_id: int
        request_ids: list[str]
        sampled_token_ids: list[int]
        step_time_s: float = 0.0
        logprobs: list[m.TokenLogprobs | None] = []
        prompt_logprobs: dict[str, list[m.TokenLogprobs]] = {}
        kv_load_bytes: int = 0
        kv_load_bytes_per_s: float = 0.0
        accepted_draft_ids: list[list[int]] = []
        num_draft_catch_up_tokens: int = 0

    old = StepResultV1(3, ["r1"], [99], 0.5, [None], {}, 0, 0.0, [[4]], 2)
    result = m.decode(msgspec.msgpack.encode(old), m.StepResult)
    assert result.expert_token_counts == [] and result.num_draft_catch_up_tokens == 2
    new = m.StepResult(3, ["r1"], [99], expert_token_counts=[[1, 2]])
    assert msgspec.msgpack.decode(m.encode(new), type=StepResultV1).sampled_token_ids == [99]

    stats = {"scheduler_id": "s", "replica_id": "0", "timestamp": 1.0, "num_running": 2}
    decoded = m.decode(msgspec.msgpack.encode(stats), ss.SchedulerStats)
    assert decoded.moe == ss.MoeStats() and decoded.moe.expert_token_counts == []
    assert decoded.num_running == 2


def test_wrong_types_are_rejected():
    bad = msgspec.msgpack.encode({"request_ids": "not-a-list"})
    with pytest.raises(msgspec.ValidationError):
        m.decode(bad, m.AbortRequest)


def test_a_failure_output_ends_its_request_with_the_error():
    output = m.RequestOutput.failure("r", 7, ERROR)
    assert output == m.RequestOutput(request_id="r", new_token_ids=[], finish_reason="error",
                                     num_prompt_tokens=7, error=ERROR)
