"""The one-shot all-reduce over peer memory (one_shot_reduce.py) on two GPUs: the same bits as
NCCL's sum at decode sizes, eagerly and replayed from a CUDA graph; sums too large for its
buffer go to NCCL; and a group formed by the worker takes it unless told not to. The fused
o_proj/down tail (kernels/all_reduce_rms_norm.py) gives the bits of the projection, NCCL's
sum and the residual add + RMSNorm, call after call, eagerly and in a graph."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import time

from types import SimpleNamespace

import pytest
import torch

from services.worker import ops
from services.worker.config import WorkerConfig
from services.worker.tp_group import free_port, join_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]

SHAPES = [(1, 4096), (7, 4096), (64, 8192), (256, 4096)]


def _sums(x: torch.Tensor, tp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x summed by NCCL, by the one-shot kernel, and by the one-shot kernel in a graph."""
    by_nccl = x.clone()
    torch.distributed.all_reduce(by_nccl, group=tp.group)
    by_one_shot = tp.all_reduce(x.clone())
    graph_input = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tp.all_reduce(graph_input.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_output = tp.all_reduce(graph_input)
    graph_input.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return by_nccl, by_one_shot, graph_output.clone()


def _rank(rank: int, port: int, results) -> None:
    tp = join_group(WorkerConfig(device=f"cuda:{rank}", tensor_parallel_size=2), rank, 2, port)
    outcome = {"one_shot": tp.one_shot is not None}
    generator = torch.Generator(device=f"cuda:{rank}").manual_seed(rank)
    for shape in SHAPES:
        x = torch.randn(shape, device=f"cuda:{rank}", dtype=torch.bfloat16, generator=generator)
        assert tp.one_shot.takes(x)
        by_nccl, by_one_shot, by_graph = _sums(x, tp)
        outcome[shape] = (torch.equal(by_nccl, by_one_shot), torch.equal(by_nccl, by_graph))
    large = torch.ones(4096, 4096, device=f"cuda:{rank}", dtype=torch.bfloat16)  # 32 MiB
    outcome["large_to_nccl"] = not tp.one_shot.takes(large) and bool(
        (tp.all_reduce(large) == 2).all())
    results.put((rank, outcome))
    torch.distributed.destroy_process_group()


# (rows, hidden size, in features): TP2 shapes of Llama-3.1-8B's o_proj and down (the skinny
# GEMM splits K at the small row counts) and of the 70B's o_proj; the most rows a slot holds
FUSED_CASES = [(1, 4096, 2048), (1, 4096, 7168), (16, 4096, 7168), (64, 4096, 2048),
               (256, 4096, 7168), (3, 8192, 4096), (128, 8192, 4096)]


def _unfused(x, proj, residual, norm, tp):
    summed = ops.linear(x, proj.weight, proj.bias)
    torch.distributed.all_reduce(summed, group=tp.group)
    return ops.rms_norm(summed, norm.weight, norm.eps, residual)


def _fused_rank(rank: int, port: int, results) -> None:
    device = f"cuda:{rank}"
    tp = join_group(WorkerConfig(device=device, tensor_parallel_size=2), rank, 2, port)
    generator = torch.Generator(device=device).manual_seed(rank)

    def randn(*shape, scale=1.0):
        return scale * torch.randn(*shape, device=device, dtype=torch.bfloat16,
                                   generator=generator)

    outcome = {}
    for round_number in range(3):  # the calls' parities alternate through the cases
        for rows, hidden, k in FUSED_CASES:
            proj = SimpleNamespace(weight=randn(hidden, k, scale=0.02), weight_scale=None,
                                   bias=randn(hidden) if rank == 0 else None)
            norm = SimpleNamespace(weight=1 + randn(hidden, scale=0.1), eps=1e-5)
            x, residual = randn(rows, k), randn(rows, hidden)
            assert tp.one_shot.takes_add_rms_norm(residual)
            expected, expected_residual = _unfused(x, proj, residual.clone(), norm, tp)
            out, summed = tp.linear_add_rms_norm(x, proj, residual.clone(), norm)
            outcome[(round_number, rows, hidden, k)] = (
                torch.equal(out, expected) and torch.equal(summed, expected_residual))
    rows, hidden, k = 1, 4096, 7168
    proj = SimpleNamespace(weight=randn(hidden, k, scale=0.02), weight_scale=None, bias=None)
    norm = SimpleNamespace(weight=1 + randn(hidden, scale=0.1), eps=1e-5)
    graph_x, graph_residual = torch.zeros(rows, k, device=device, dtype=torch.bfloat16), \
        torch.zeros(rows, hidden, device=device, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tp.linear_add_rms_norm(graph_x, proj, graph_residual.clone(), norm)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, _ = tp.linear_add_rms_norm(graph_x, proj, graph_residual, norm)
    for replay in range(4):
        x, residual = randn(rows, k), randn(rows, hidden)
        expected, expected_residual = _unfused(x, proj, residual.clone(), norm, tp)
        graph_x.copy_(x)
        graph_residual.copy_(residual)
        graph.replay()
        outcome[("graph", replay)] = (torch.equal(graph_out, expected)
                                      and torch.equal(graph_residual, expected_residual))
    torch.cuda.synchronize()
    results.put((rank, outcome))
    torch.distributed.destroy_process_group()


def _disabled_rank(rank: int, port: int, results) -> None:
    config = WorkerConfig(device=f"cuda:{rank}", tensor_parallel_size=2,
                          disable_custom_all_reduce=True)
    results.put((rank, join_group(config, rank, 2, port).one_shot is None))
    torch.distributed.destroy_process_group()


def _run_pair(target) -> dict:
    context = multiprocessing.get_context("spawn")
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=target, args=(rank, port, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    outcomes, deadline = {}, time.monotonic() + 300
    try:
        while len(outcomes) < len(processes):  # a rank that died fails the test at once
            assert time.monotonic() < deadline, "the ranks took over 300 s"
            assert all(p.exitcode in (None, 0) for p in processes), [p.exitcode for p in processes]
            with contextlib.suppress(queue.Empty):
                rank, outcome = results.get(timeout=1)
                outcomes[rank] = outcome
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
    finally:
        for process in processes:  # (one left waiting on a dead peer)
            if process.is_alive():
                process.kill()
    return outcomes


def test_one_shot_sums_are_nccls_bits_in_and_out_of_graphs():
    for rank, outcome in _run_pair(_rank).items():
        assert outcome.pop("one_shot"), f"rank {rank} formed no one-shot all-reduce"
        assert outcome.pop("large_to_nccl")
        assert all(eager and graphed for eager, graphed in outcome.values()), (rank, outcome)


def test_the_fused_tail_gives_the_unfused_ops_bits_call_after_call():
    for rank, outcome in _run_pair(_fused_rank).items():
        assert all(outcome.values()), (rank, [key for key, ok in outcome.items() if not ok])


def test_disable_custom_all_reduce_keeps_every_sum_with_nccl():
    assert all(_run_pair(_disabled_rank).values())
