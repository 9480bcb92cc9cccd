"""The worker and scheduler flags shared by `flotilla serve` and the stacks `flotilla bench`
starts reach the right services."""

from __future__ import annotations

from cli.engine_flags import engine_service_args
from cli.main import build_parser, main


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
