"""`flotilla serve`'s flags: made from the services' sections (each knob once), validated in
process before anything starts, and passed to the services that read them; `flotilla bench`
starts its stacks the same way."""

from __future__ import annotations

import pytest
import torch

from cli.main import build_parser, main
from cli.serve_flags import SERVICE_CONFIGS, Serve, serve_knobs, stack_configs, stack_options
from shared.config import ConfigError, knobs_of


def configs(*argv: str, command=("serve",)) -> dict:
    return stack_configs(vars(build_parser().parse_args([*command, *argv])), environ={})


def service_args(*argv: str, command=("serve",)) -> dict[str, list[str]]:
    return stack_options(configs(*argv, command=command), supervise=False).service_args


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    visible(1)
    return visible


def test_every_serve_flag_is_one_knob_of_one_section_and_every_service_knob_has_a_flag():
    """A service's knob is serve's flag of the same section, unless the stack sets it per
    process (serve=False): then serve has no flag of that name, or its own (Serve's)."""
    knobs = {k.name: k for k in serve_knobs()}
    assert len(knobs) == len(serve_knobs())
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert {k.flag for k in knobs.values()} <= set(serve._option_string_actions)
    for config_cls in SERVICE_CONFIGS.values():
        for k in knobs_of(config_cls):
            owner = knobs.get(k.name)
            if k.serve:
                assert owner is not None and owner.section is k.section, k.name
            else:
                assert owner is None or owner.section is Serve, k.name


def test_serve_and_bench_pass_the_same_engine_flags(gpus):
    engine = ["--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--device", "cuda",
              "--gpu-memory-utilization", "0.8", "--max-model-len", "4096", "--enforce-eager"]
    serve = service_args(*engine)
    bench = service_args(*engine, command=("bench", "throughput"))
    for kind in ("worker", "scheduler", "tokenizer"):
        assert serve[kind] == bench[kind], kind
    worker, scheduler = serve["worker"], serve["scheduler"]
    for flag, value in (("--max-num-seqs", "8"), ("--max-num-batched-tokens", "512"),
                        ("--device", "cuda"), ("--gpu-memory-utilization", "0.8"),
                        ("--max-model-len", "4096")):
        assert worker[worker.index(flag) + 1] == value
    assert "--enforce-eager" in worker
    assert scheduler == ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
    # one context length for the tokenizer (so the gateway) and the worker
    assert serve["tokenizer"] == ["--max-model-len", "4096"]


def test_unset_flags_are_left_to_the_services_defaults():
    args = service_args("--device", "cpu")
    assert args["worker"] == ["--device", "cpu"]
    assert args["scheduler"] == args["tokenizer"] == args["gateway"] == []


def test_batch_limits_default_to_vllms_on_a_gpu(gpus):
    gpu_limits = ["--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"]
    args = service_args("--device", "cuda:0")
    assert args["worker"][:4] == gpu_limits and args["scheduler"] == gpu_limits
    assert service_args("--device", "cuda:0", "--max-num-seqs", "16")["scheduler"] == \
        ["--max-num-seqs", "16", "--max-num-batched-tokens", "16384"]
    assert service_args("--device", "cpu")["scheduler"] == []


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "fp8"], "--quantization fp8 needs a CUDA GPU"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs a CUDA GPU"),
    (["--batch-invariant"], "--batch-invariant needs a worker on one CUDA GPU"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config"),
    (["--speculative-config", "{nope"], "--speculative-config is not JSON"),
    (["--max-num-seqs", "0"], "--max-num-seqs and --max-num-batched-tokens must be at least 1"),
    (["--max-num-seqs", "many"], "invalid value for --max-num-seqs"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be at least 1, not 0"),
    (["--gateway-workers", "0"], "--gateway-workers must be at least 1, not 0"),
    (["--chunk-step-ratio", "nan"], "--chunk-step-ratio must be a number, 0 or more"),
    (["--max-decode-stall-ms", "-1"], "--max-decode-stall-ms must be a number, 0 or more"),
    (["--kv-host-memory", "lots"], "--kv-host-memory: not a size"),
    (["--routing-saturation-ratio", "-1"], "routing saturation margin and ratio"),
])
def test_serve_refuses_a_bad_value_naming_its_flag_before_starting_anything(capsys, argv,
                                                                           message):
    """Exit 2 with the reason at once, instead of a stack restarting a service that cannot
    start until it gives up."""
    assert main(["serve", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cuda_only_flags_pass_on_a_gpu(gpus):
    worker = service_args("--device", "cuda", "--quantization", "fp8")["worker"]
    assert worker[worker.index("--quantization") + 1] == "fp8"
    assert "--batch-invariant" in service_args("--device", "cuda:0", "--batch-invariant")["worker"]
    gpus(2)
    with pytest.raises(ConfigError, match="--batch-invariant runs on one GPU"):
        configs("--device", "cuda:0", "--batch-invariant", "--tensor-parallel-size", "2")


def test_the_speculative_config_reaches_scheduler_and_worker_whole():
    spec = '{"method": "draft_model", "model": "dummy:llama-3.2-1b"}'
    built = configs("--device", "cpu", "--speculative-config", spec)
    assert built["scheduler"].speculative_config == built["worker"].speculative_config
    assert built["worker"].draft_model == "dummy:llama-3.2-1b"
    assert built["worker"].num_speculative_tokens == 4
    for kind in ("worker", "scheduler"):  # as JSON of the fields not at their defaults
        args = service_args("--device", "cpu", "--speculative-config", spec)[kind]
        assert args[args.index("--speculative-config") + 1] == \
            '{"method":"draft_model","model":"dummy:llama-3.2-1b"}'
    assert configs("--device", "cpu")["worker"].speculative_config is None


def test_tensor_parallel_size_reaches_only_the_worker():
    for command in (("serve",), ("bench", "throughput")):
        args = service_args("--device", "cpu", "--tensor-parallel-size", "2", command=command)
        assert args["worker"] == ["--device", "cpu", "--tensor-parallel-size", "2"]
        assert args["scheduler"] == args["tokenizer"] == []
    assert stack_options(configs("--device", "cpu", "--tensor-parallel-size", "2"),
                         supervise=False).kvstore is False  # no kvstore for a TP worker yet


@pytest.mark.parametrize("argv, visible, error", [
    (["--tensor-parallel-size", "2", "--replicas", "2"], 4, None),
    (["--tensor-parallel-size", "2", "--replicas", "2"], 3, "needs 4 GPUs, but 3 are visible"),
    (["--tensor-parallel-size", "4"], 2, "needs 4 GPUs, but 2 are visible"),
    (["--replicas", "2"], 1, "needs 2 GPUs, but 1 is visible"),
    ([], 1, None),
])
def test_serve_counts_the_gpus_its_replicas_need(gpus, argv, visible, error):
    gpus(visible)
    if error is None:
        configs("--device", "cuda", *argv)
    else:
        with pytest.raises(ConfigError, match=error):
            configs("--device", "cuda", *argv)


def test_a_device_with_an_index_is_shared_by_the_replicas(gpus):
    """--device cuda:0 names the GPU every replica uses: one GPU is enough, and the stack
    leaves the workers' CUDA_VISIBLE_DEVICES alone."""
    options = stack_options(configs("--device", "cuda:0", "--replicas", "2"), supervise=False)
    assert options.worker_gpus is None


def test_bench_counts_one_replica(gpus):
    gpus(2)
    bench = build_parser().parse_args(["bench", "throughput", "--device", "cuda",
                                       "--tensor-parallel-size", "2"])
    assert not hasattr(bench, "replicas")
    built = stack_configs(vars(bench), environ={})
    assert stack_options(built, supervise=False).worker_gpus == 2
    gpus(1)
    with pytest.raises(ConfigError, match="needs 2 GPUs, but 1 is visible"):
        stack_configs(vars(bench), environ={})


def test_the_stack_picks_gpus_only_for_workers_on_cuda(gpus):
    assert stack_options(configs("--device", "cpu", "--tensor-parallel-size", "2"),
                         supervise=False).worker_gpus is None
    gpus(3)
    assert stack_options(configs("--device", "cuda", "--replicas", "3"),
                         supervise=False).worker_gpus == 1


def test_variables_are_checked_before_anything_starts_too():
    with pytest.raises(ConfigError, match="invalid value for --max-num-seqs"):
        stack_configs(vars(build_parser().parse_args(["serve", "--device", "cpu"])),
                      environ={"FLOTILLA_MAX_NUM_SEQS": "many"})


def test_docs_flags_md_is_made_from_the_sections():
    """Stale? Run: python -m cli.flags_doc > docs/flags.md"""
    from pathlib import Path

    from cli.flags_doc import render

    assert (Path(__file__).parents[2] / "docs" / "flags.md").read_text() == render()
    assert "| `--kv-load-layer-groups` | `8` | worker |" in render()


def test_serve_gives_the_lora_knobs_to_the_scheduler_and_the_worker():
    configs = stack_configs({"enable_lora": True, "lora_modules": "a=/adapters/a",
                             "max_loras": 2})
    for kind in ("scheduler", "worker"):
        assert configs[kind].enable_lora and configs[kind].max_loras == 2
        assert configs[kind].lora_module_list == [("a", "/adapters/a")]
    with pytest.raises(ConfigError, match="--lora-modules needs --enable-lora"):
        stack_configs({"lora_modules": "a=/adapters/a"})
