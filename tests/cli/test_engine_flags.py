"""The worker and scheduler flags shared by `flotilla serve` and the stacks `flotilla bench`
starts reach the right services."""

from __future__ import annotations

import pytest
import torch

from cli.engine_flags import engine_flag_error, engine_service_args, gpus_per_replica
from cli.main import build_parser, main, serve_options


def test_serve_and_bench_pass_the_same_engine_flags():
    engine = ["--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--device", "cuda",
              "--gpu-memory-utilization", "0.8", "--max-model-len", "4096", "--enforce-eager"]
    serve = build_parser().parse_args(["serve", *engine])
    bench = build_parser().parse_args(["bench", "throughput", *engine])
    expected = {
        "worker": ["--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--device", "cuda",
                   "--gpu-memory-utilization", "0.8", "--max-model-len", "4096",
                   "--enforce-eager"],
        "scheduler": ["--max-num-seqs", "8", "--max-num-batched-tokens", "512"],
        # one context length for the tokenizer (so the gateway) and the worker
        "tokenizer": ["--max-model-len", "4096"]}
    assert engine_service_args(serve) == expected
    assert engine_service_args(bench) == expected


def test_unset_flags_are_left_to_the_services_defaults():
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    assert engine_service_args(args) == {"worker": ["--device", "cpu"], "scheduler": [],
                                         "tokenizer": []}


def test_batch_limits_default_to_vllms_on_a_gpu():
    args = build_parser().parse_args(["serve", "--device", "cuda:0"])
    gpu_limits = ["--max-num-seqs", "1024", "--max-num-batched-tokens", "16384"]
    assert engine_service_args(args) == {"worker": gpu_limits + ["--device", "cuda:0"],
                                         "scheduler": gpu_limits, "tokenizer": []}
    cpu = build_parser().parse_args(["serve", "--device", "cpu"])
    assert engine_service_args(cpu) == {"worker": ["--device", "cpu"], "scheduler": [],
                                        "tokenizer": []}


def test_serve_refuses_flags_its_services_would_refuse_before_starting_anything(capsys):
    """Exit 2 with the reason at once, instead of a stack restarting a worker (or scheduler)
    that cannot start until it gives up."""
    assert main(["serve", "--device", "cpu", "--quantization", "fp8"]) == 2
    assert "--quantization fp8 needs a CUDA GPU" in capsys.readouterr().err
    assert main(["serve", "--device", "cpu", "--speculative-config", '{"method": "eagle"}']) == 2
    assert "--speculative-config" in capsys.readouterr().err
    gpu = build_parser().parse_args(["serve", "--device", "cuda", "--quantization", "fp8"])
    assert engine_service_args(gpu)["worker"][-2:] == ["--quantization", "fp8"]
    assert main(["serve", "--device", "cpu", "--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-dtype fp8 needs a CUDA GPU" in capsys.readouterr().err
    gpu = build_parser().parse_args(["serve", "--device", "cuda", "--kv-cache-dtype", "fp8"])
    assert engine_service_args(gpu)["worker"][-2:] == ["--kv-cache-dtype", "fp8"]
    assert main(["serve", "--device", "cpu", "--batch-invariant"]) == 2
    assert "--batch-invariant needs a worker on one CUDA GPU" in capsys.readouterr().err
    gpu = build_parser().parse_args(["serve", "--device", "cuda:0", "--batch-invariant"])
    assert engine_service_args(gpu)["worker"][-1] == "--batch-invariant"
    split = build_parser().parse_args(["serve", "--device", "cuda:0", "--batch-invariant",
                                       "--tensor-parallel-size", "2"])
    assert "--batch-invariant needs a worker on one CUDA GPU" in engine_flag_error(split)


def test_a_draft_model_in_the_speculative_config_reaches_the_worker():
    spec = '{"method": "draft_model", "model": "dummy:llama-3.2-1b"}'
    args = build_parser().parse_args(["serve", "--device", "cpu", "--speculative-config", spec])
    options = serve_options(args)
    worker = options.service_args["worker"]
    assert worker[worker.index("--draft-model") + 1] == "dummy:llama-3.2-1b"
    assert worker[worker.index("--num-speculative-tokens") + 1] == "4"
    assert "--draft-model" not in options.service_args["scheduler"]
    assert "--draft-model" not in serve_options(build_parser().parse_args(
        ["serve", "--device", "cpu"])).service_args["worker"]


def test_tensor_parallel_size_reaches_only_the_worker():
    for command in (["serve"], ["bench", "throughput"]):
        args = build_parser().parse_args([*command, "--device", "cpu",
                                          "--tensor-parallel-size", "2"])
        assert engine_service_args(args) == {"worker": ["--device", "cpu",
                                                        "--tensor-parallel-size", "2"],
                                             "scheduler": [], "tokenizer": []}


def test_serve_refuses_a_tensor_parallel_size_below_one(capsys):
    assert main(["serve", "--device", "cpu", "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size must be at least 1, not 0" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--device", "cpu", "--tensor-parallel-size", "2"])
    assert engine_flag_error(args) is None  # on CPU the group is processes: no GPU to count


@pytest.mark.parametrize("argv, gpus, error", [
    (["--tensor-parallel-size", "2", "--replicas", "2"], 4, None),
    (["--tensor-parallel-size", "2", "--replicas", "2"], 3, "needs 4 GPUs, but 3 are visible"),
    (["--tensor-parallel-size", "4"], 2, "needs 4 GPUs, but 2 are visible"),
    (["--replicas", "2"], 1, "needs 2 GPUs, but 1 is visible"),
    ([], 1, None),
])
def test_serve_counts_the_gpus_its_replicas_need(monkeypatch, argv, gpus, error):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = build_parser().parse_args(["serve", "--device", "cuda", *argv])
    message = engine_flag_error(args)
    assert (message is None) if error is None else (error in message)


def test_a_device_with_an_index_is_shared_by_the_replicas(monkeypatch):
    """--device cuda:0 names the GPU every replica uses (as before): one GPU is enough, and the
    stack leaves the workers' CUDA_VISIBLE_DEVICES alone."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = build_parser().parse_args(["serve", "--device", "cuda:0", "--replicas", "2"])
    assert engine_flag_error(args) is None and gpus_per_replica(args) is None


def test_bench_counts_one_replica(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    bench = build_parser().parse_args(["bench", "throughput", "--device", "cuda",
                                       "--tensor-parallel-size", "2"])
    assert not hasattr(bench, "replicas")
    assert engine_flag_error(bench) is None and gpus_per_replica(bench) == 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "needs 2 GPUs, but 1 is visible" in engine_flag_error(bench)


def test_the_stack_picks_gpus_only_for_workers_on_cuda():
    cpu = build_parser().parse_args(["serve", "--device", "cpu", "--tensor-parallel-size", "2"])
    assert gpus_per_replica(cpu) is None
    gpu = build_parser().parse_args(["serve", "--device", "cuda", "--replicas", "3"])
    assert gpus_per_replica(gpu) == 1
