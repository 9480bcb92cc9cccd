"""Each replica's worker of a GPU stack gets GPUs of its own (CUDA_VISIBLE_DEVICES): its
tensor parallel size of them, after the replicas before it; CPU stacks' environment as it was."""

from __future__ import annotations

import pytest
import torch

from cli.main import build_parser, serve_options
from cli.stack import Stack, StackOptions, replica_gpus


@pytest.mark.parametrize("replica, size, visible, expected", [
    (0, 1, None, "0"),
    (2, 1, None, "2"),
    (0, 2, None, "0,1"),
    (1, 2, None, "2,3"),
    (1, 2, "4,5,6,7", "6,7"),  # the launcher's own list, indexed
    (1, 1, "GPU-aaa, GPU-bbb", "GPU-bbb"),  # UUIDs too, spaces dropped
    (0, 4, "3,2,1,0", "3,2,1,0"),
])
def test_replica_gpus(replica, size, visible, expected):
    assert replica_gpus(replica, size, visible) == expected


def test_replica_gpus_beyond_the_visible_list_fail_clearly():
    with pytest.raises(ValueError, match=r"replica 1 needs GPUs 2\.\.3 of "
                                         r"CUDA_VISIBLE_DEVICES='0,1,2', which lists 3"):
        replica_gpus(1, 2, "0,1,2")
    with pytest.raises(ValueError, match="which lists 0"):
        replica_gpus(0, 1, "")


def gpu_env(stack: Stack, name: str) -> str | None:
    return stack.service_env(name).get("CUDA_VISIBLE_DEVICES")


def test_each_replica_worker_gets_its_own_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    stack = Stack(StackOptions(replicas=2, worker_gpus=2))
    assert (gpu_env(stack, "worker"), gpu_env(stack, "worker-1")) == ("0,1", "2,3")
    for name in ("scheduler", "scheduler-1", "tokenizer", "gateway", "kvstore"):
        assert gpu_env(stack, name) is None, name
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4")
    assert (gpu_env(stack, "worker"), gpu_env(stack, "worker-1")) == ("7,6", "5,4")
    assert gpu_env(stack, "scheduler") == "7,6,5,4"  # no GPU work there: left as it was


def test_the_stacks_env_is_the_list_indexed(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    stack = Stack(StackOptions(replicas=2, worker_gpus=1, env={"CUDA_VISIBLE_DEVICES": "2,3"}))
    assert (gpu_env(stack, "worker"), gpu_env(stack, "worker-1")) == ("2", "3")


def test_one_replica_on_one_gpu_and_cpu_stacks_keep_their_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpu_env(Stack(StackOptions(worker_gpus=1)), "worker") == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_env(Stack(StackOptions(worker_gpus=1)), "worker") is None
    cpu = Stack(StackOptions(replicas=3))
    assert [gpu_env(cpu, name) for name in ("worker", "worker-1", "worker-2")] == [None] * 3
    assert Stack(StackOptions(worker_gpus=2)).service_env("worker")["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_serve_gives_the_stack_the_tensor_parallel_size(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # (serve counts them first)
    args = build_parser().parse_args(["serve", "--device", "cuda", "--replicas", "2",
                                      "--tensor-parallel-size", "2"])
    stack = Stack(serve_options(args))
    assert stack.options.worker_gpus == 2
    assert gpu_env(stack, "worker-1") == "2,3"
    cpu = build_parser().parse_args(["serve", "--device", "cpu", "--replicas", "2",
                                     "--tensor-parallel-size", "2"])
    assert serve_options(cpu).worker_gpus is None
    assert gpu_env(Stack(serve_options(cpu)), "worker-1") is None
