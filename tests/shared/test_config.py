from __future__ import annotations

from typing import Annotated

import pytest

import msgspec

from services.gateway.config import GatewayConfig, RoutingPolicy
from services.scheduler.config import SchedulerConfig, SchedulingPolicy
from services.kvstore.config import KvStoreConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import Dtype, OverlapSteps, WorkerConfig
from shared.config import Section, build_parser, compose, knob, knobs_of, load_config, parse_size
from shared.sections.engine import BatchLimits
from shared.subjects import Subjects


def test_flags_beat_env_which_beats_defaults():
    env = {"FLOTILLA_MAX_NUM_SEQS": "7", "FLOTILLA_NAMESPACE": "prod", "FLOTILLA_LOG_JSON": "true"}
    config = load_config(SchedulerConfig, ["--namespace", "dev"], env)
    assert config.namespace == "dev" and config.max_num_seqs == 7 and config.log_json is True
    assert config.max_num_batched_tokens == SchedulerConfig().max_num_batched_tokens
    assert config.instance_id  # generated


def test_bad_values_exit_with_a_message():
    with pytest.raises(SystemExit, match="--max-num-seqs"):
        load_config(SchedulerConfig, ["--max-num-seqs", "many"], {})


def test_choices_are_enums_from_flags_and_env():
    config = load_config(WorkerConfig, ["--dtype", "bfloat16"], {"FLOTILLA_OVERLAP_STEPS": "off"})
    assert config.dtype is Dtype.BFLOAT16 and config.overlap_steps is OverlapSteps.OFF
    assert load_config(SchedulerConfig, [], {"FLOTILLA_SCHEDULING_POLICY": "priority"}
                       ).scheduling_policy is SchedulingPolicy.PRIORITY
    # the wire and the flags keep the plain strings
    assert msgspec.json.decode(msgspec.json.encode(config))["dtype"] == "bfloat16"
    assert "{kv,least-loaded,round-robin}" in build_parser(GatewayConfig).format_help()


def test_a_bad_choice_exits_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        load_config(GatewayConfig, ["--routing", "random"], {})
    assert "invalid choice: 'random'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="routing must be one of kv, least-loaded, round-robin, "
                                         "not 'random'"):
        load_config(GatewayConfig, [], {"FLOTILLA_ROUTING": "random"})


def test_a_config_built_in_code_checks_its_choices():
    with pytest.raises(ValueError, match="routing must be one of"):
        GatewayConfig(routing="random")
    assert GatewayConfig(routing="round-robin").routing == RoutingPolicy.ROUND_ROBIN


@pytest.mark.parametrize("text,size", [("1000", 1000), ("2GiB", 2 << 30), ("512MiB", 512 << 20),
                                       ("1.5G", 1_500_000_000), ("64 KB", 64_000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError):
        parse_size("lots")


@pytest.mark.parametrize("values", [{"gpu_memory_utilization": 0.0},
                                    {"gpu_memory_utilization": 1.5}, {"max_num_seqs": 0}])
def test_worker_config_refuses_impossible_limits(values):
    with pytest.raises(ValueError):
        WorkerConfig(**values)


def test_worker_config_defaults():
    config = WorkerConfig()
    assert config.kv_cache_memory == "auto" and config.gpu_memory_utilization == 0.9
    assert not config.enforce_eager


def test_subjects_are_namespaced():
    a, b = Subjects("a"), Subjects("b")
    assert a.tokenizer_encode == "a.v1.tokenizer.encode"
    assert a.worker_step("0") == "a.v1.worker.0.step"
    assert a.scheduler_stats == "a.v1.evt.scheduler.stats"
    assert a.gateway_outputs("g1") != b.gateway_outputs("g1")


class One(Section, frozen=True, kw_only=True):
    size: Annotated[int, knob("how many")] = 1


class Other(Section, frozen=True, kw_only=True):
    size: Annotated[int, knob("how many, again")] = 2


class Bare(Section, frozen=True, kw_only=True):
    size: int = 1


def test_a_service_config_is_its_sections_each_knob_declared_once():
    for config_cls in (GatewayConfig, KvStoreConfig, SchedulerConfig, TokenizerConfig,
                       WorkerConfig):
        fields = [f.name for f in msgspec.structs.fields(config_cls)]
        knobs = knobs_of(config_cls)
        assert [k.name for k in knobs] == fields  # every field is one section's knob
        assert all(k.help for k in knobs)
        help_text = build_parser(config_cls).format_help()
        assert all(k.flag in help_text for k in knobs)

    with pytest.raises(TypeError, match="size is in One and Other"):
        compose("Both", "", (One, Other), module=__name__)

    with pytest.raises(TypeError, match="has no help"):
        knobs_of(compose("Bare", "", (Bare,), module=__name__))


def test_a_section_checks_its_values_in_every_config_that_has_it():
    with pytest.raises(ValueError, match="max_num_seqs"):
        WorkerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    assert SchedulerConfig(max_num_seqs=3).section(BatchLimits) == BatchLimits(max_num_seqs=3)
