"""Tensor parallelism's all-reduce at decode sizes: NCCL against the one-shot sum over peer
memory (services/worker/one_shot_reduce.py), each timed inside a CUDA graph as the worker
runs it, and checked for equal bits.

    python3 -m benchmarks.gpu.all_reduce [--world-size 2] [--hidden 4096,8192]
        [--tokens 1,8,32,64,128,256,512] [--result-json PATH]

One process per GPU. Prints, per size, microseconds per all-reduce for both paths.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.distributed
import torch.multiprocessing

from services.worker.one_shot_reduce import OneShotReduce

REPLAYS = 20  # all-reduces captured in one graph
GRAPH_RUNS = 50


def graph_time_us(run, *tensors: torch.Tensor) -> float:
    """Microseconds per call of ``run`` over REPLAYS calls captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            run()
    graph.replay()
    torch.cuda.synchronize()
    torch.distributed.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(GRAPH_RUNS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (GRAPH_RUNS * REPLAYS)


def rank_main(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=world_size, device_id=device)
    group = torch.distributed.group.WORLD
    one_shot = OneShotReduce(group, device, max_bytes=max(args.tokens) * max(args.hidden) * 2)
    rows = []
    for hidden in args.hidden:
        for num_tokens in args.tokens:
            generator = torch.Generator(device=device).manual_seed(rank * 1000 + num_tokens)
            x = torch.randn(num_tokens, hidden, device=device, dtype=torch.bfloat16,
                            generator=generator)
            by_nccl, by_one_shot = x.clone(), x.clone()
            torch.distributed.all_reduce(by_nccl, group=group)
            one_shot.all_reduce(by_one_shot)
            torch.cuda.synchronize()
            equal = bool(torch.equal(by_nccl, by_one_shot))
            nccl_us = graph_time_us(lambda: torch.distributed.all_reduce(by_nccl, group=group))
            one_shot_us = graph_time_us(lambda: one_shot.all_reduce(by_one_shot))
            rows.append({"hidden": hidden, "num_tokens": num_tokens,
                         "bytes": num_tokens * hidden * 2, "nccl_us": round(nccl_us, 2),
                         "one_shot_us": round(one_shot_us, 2), "equal_bits": equal})
    if rank == 0:
        queue.put(rows)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", default="4096,8192")
    parser.add_argument("--tokens", default="1,8,32,64,128,256,512")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    args.hidden = [int(h) for h in args.hidden.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = torch.multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=rank_main, args=(rank, args.world_size, port, args,
                                                         queue)) for rank in range(args.world_size)]
    for process in processes:
        process.start()
    rows = queue.get(timeout=600)
    for process in processes:
        process.join(60)
    print(f"{'hidden':>7} {'tokens':>7} {'KiB':>7} {'NCCL us':>9} {'one-shot us':>12} equal")
    for row in rows:
        print(f"{row['hidden']:>7} {row['num_tokens']:>7} {row['bytes'] / 1024:>7.0f} "
              f"{row['nccl_us']:>9} {row['one_shot_us']:>12} {row['equal_bits']}")
    if args.result_json:
        with open(args.result_json, "w") as out:
            json.dump({"world_size": args.world_size, "rows": rows,
                       "device": torch.cuda.get_device_name(0),
                       "nccl_nvls": os.environ.get("NCCL_NVLS_ENABLE")}, out, indent=2)


if __name__ == "__main__":
    main()
