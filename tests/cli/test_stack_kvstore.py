"""``flotilla serve`` runs the node's kvstore by default: started before the workers, its
node id given to every worker and scheduler, its flags passed through; --no-kvstore."""

from __future__ import annotations

import pytest

from cli.main import build_parser, serve_options
from cli.stack import Stack, StackOptions
from services.worker.config import WorkerConfig
from shared.config import load_config


def command(stack: Stack, name: str) -> list[str]:
    stack.nats_url = "nats://127.0.0.1:1"
    return stack.service_command(name)


def value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_serve_starts_the_kvstore_with_its_flags():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--replicas", "2",
                                      "--kv-host-memory", "8GiB", "--kv-disk-dir", "/var/kv",
                                      "--kv-disk-size", "100GiB"])
    stack = Stack(serve_options(args))
    names = stack.service_names()
    assert names.index("kvstore") < min(names.index("worker"), names.index("worker-1"))
    kvstore = command(stack, "kvstore")
    assert kvstore[2] == "services.kvstore" and value(kvstore, "--node-id") == "local"
    assert (value(kvstore, "--kv-host-memory"), value(kvstore, "--kv-disk-dir"),
            value(kvstore, "--kv-disk-size")) == ("8GiB", "/var/kv", "100GiB")
    assert value(kvstore, "--shutdown-timeout") == "30"  # it finishes its disk writes
    for name in ("worker", "worker-1", "scheduler", "scheduler-1"):
        assert value(command(stack, name), "--kv-node-id") == "local"
    assert "--kv-node-id" not in command(stack, "gateway")


def test_no_kvstore():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--no-kvstore"])
    stack = Stack(serve_options(args))
    assert "kvstore" not in stack.service_names()
    assert "--kv-node-id" not in command(stack, "worker")
    assert "--kv-node-id" not in command(stack, "scheduler")


def test_defaults_leave_the_sizes_to_the_kvstore_and_name_the_node():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--kv-node-id", "gpu-node-7"])
    stack = Stack(serve_options(args))
    kvstore = command(stack, "kvstore")
    assert value(kvstore, "--kv-host-memory") is None and value(kvstore, "--node-id") == "gpu-node-7"
    assert value(command(stack, "scheduler"), "--kv-node-id") == "gpu-node-7"
    assert StackOptions().kvstore  # the integration tests' stacks run one too


def test_kv_load_layer_groups_reach_every_worker_and_parse():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--replicas", "2",
                                      "--kv-load-layer-groups", "4"])
    stack = Stack(serve_options(args))
    for name in ("worker", "worker-1"):
        worker = command(stack, name)
        assert value(worker, "--kv-load-layer-groups") == "4"
        flags = worker[worker.index("services.worker") + 1:]
        assert load_config(WorkerConfig, flags, environ={}).kv_load_layer_groups == 4
    assert "--kv-load-layer-groups" not in command(stack, "scheduler")
    default = Stack(serve_options(build_parser().parse_args(["serve", "--device", "cpu"])))
    assert "--kv-load-layer-groups" not in command(default, "worker")
    assert load_config(WorkerConfig, [], environ={}).kv_load_layer_groups == 8
    with pytest.raises(SystemExit, match="--kv-load-layer-groups must be at least 1"):
        load_config(WorkerConfig, ["--kv-load-layer-groups", "0"], environ={})
