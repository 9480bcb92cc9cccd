"""One gateway process under many streams (issue 27): the CPU each streamed chunk costs it,
and how late the chunks reach the clients when steps come at a fixed pace.

    python -m benchmarks.gateway_streams [--streams 500] [--step-ms 50] [--tokens 100]

A real nats-server, tokenizer service and gateway (``python -m services.gateway``, the
default model's tokenizer). In place of a scheduler and worker, this script answers the
gateway's submits and, every ``--step-ms``, publishes one OutputBatch to the gateway with
one token for every open stream (as a scheduler does after each step), so the offered load
is streams x 1000 / step-ms chunks per second whatever the machine. Clients in a second
process stream completions over plain sockets (no HTTP library: the client must cost less
than the server) and time every SSE event.

``--gateway-workers N`` starts N gateway processes on the port (SO_REUSEPORT, as
``flotilla serve --gateway-workers N``): the kernel spreads the clients' connections.

Reported: the gateways' CPU time per chunk (user + system, /proc, over the steady part),
the chunks delivered per second, and the gaps between a stream's chunks (p50, p99, max:
with a gateway that keeps up they equal --step-ms). Results: $OUT/gateway_streams.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out"))
FAKE_ID = "bench-scheduler"


class FakeScheduler:
    """Answers submits and publishes a step's outputs every ``step_s`` for the open streams."""

    def __init__(self, bus, subjects, step_s: float, token_id: int) -> None:
        self.bus, self.subjects, self.step_s, self.token_id = bus, subjects, step_s, token_id
        self.open: dict[str, list] = {}  # request id -> [output subject, tokens left, first]
        self.num_steps = 0

    async def start(self) -> None:
        from shared.messages import AbortRequest, GenerateRequest

        await self.bus.serve(self.subjects.scheduler_submit_to(FAKE_ID), GenerateRequest,
                             self.on_submit)
        await self.bus.serve(self.subjects.scheduler_abort(FAKE_ID), AbortRequest, self.on_abort)

    async def on_submit(self, request):
        from shared.messages import SubmitReply

        self.open[request.request_id] = [request.output_subject, request.sampling.max_tokens,
                                         True, len(request.prompt_token_ids)]
        return SubmitReply(scheduler_id=FAKE_ID)

    async def on_abort(self, request):
        from shared.messages import Empty

        for request_id in request.request_ids:
            self.open.pop(request_id, None)
        return Empty()

    async def stats_loop(self, model_name: str) -> None:
        from shared.scheduler_stats import EngineStats, RoutingStats, SchedulerStats

        while True:
            await self.bus.publish(self.subjects.scheduler_stats, SchedulerStats(
                scheduler_id=FAKE_ID, replica_id="0", timestamp=time.time(),
                num_running=len(self.open), num_waiting=0,
                routing=RoutingStats(block_size=16, model_name=model_name),
                engine=EngineStats(num_blocks_total=100_000)))
            await asyncio.sleep(0.5)

    async def step_loop(self) -> None:
        from shared.messages import OutputBatch, RequestOutput

        next_at = time.monotonic()
        while True:
            by_subject: dict[str, list] = {}
            for request_id, state in list(self.open.items()):
                subject, left, first, num_prompt = state
                state[1], state[2] = left - 1, False
                finish = "length" if left == 1 else None
                by_subject.setdefault(subject, []).append(RequestOutput(
                    request_id=request_id, new_token_ids=[self.token_id], finish_reason=finish,
                    num_prompt_tokens=num_prompt if first else 0))
                if finish:
                    del self.open[request_id]
            for subject, outputs in by_subject.items():
                await self.bus.publish(subject, OutputBatch(outputs))
            self.num_steps += 1
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


# ------------------------------------------------------------------ clients
async def _stream(port: int, body: bytes, started: float) -> list[float]:
    """One streaming completion over a plain socket: the arrival time of each SSE event,
    then -1 if the stream ended with [DONE]."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json"
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    times: list[float] = []
    try:
        while line := await reader.readline():
            if line.startswith(b"data: "):
                if line.startswith(b"data: [DONE]"):
                    times.append(-1.0)
                    break
                times.append(time.monotonic() - started)
    finally:
        writer.close()
    return times


async def _clients(port: int, model: str, num_streams: int, num_tokens: int) -> list[list[float]]:
    body = json.dumps({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": num_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    started = time.monotonic()
    return await asyncio.gather(*(_stream(port, body, started) for _ in range(num_streams)))


def client_process(port: int, model: str, num_streams: int, num_tokens: int, queue) -> None:
    queue.put(asyncio.run(_clients(port, model, num_streams, num_tokens)))


# ------------------------------------------------------------------ measurement
def profile(pid: int, path: str):
    """py-spy (when installed) on the gateway: a flame graph (SVG) of where its time went."""
    import subprocess

    fmt = ["--format", "raw"] if path.endswith(".txt") else []
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "500", *fmt,
                             "--output", path], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(times: list[list[float]], cpu_s: float, window_s: float, args) -> dict:
    num_done = sum(bool(stream) and stream[-1] == -1.0 for stream in times)
    times = [[t for t in stream if t >= 0] for stream in times]
    gaps = sorted(later - earlier for stream in times for earlier, later in zip(stream, stream[1:]))
    num_chunks = sum(len(stream) for stream in times)

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3 if gaps else float("nan")

    return {"streams": args.streams, "step_ms": args.step_ms, "tokens": args.tokens,
            "gateway_workers": args.gateway_workers,
            "offered_chunks_per_s": args.streams * 1000 / args.step_ms,
            "delivered_chunks": num_chunks, "delivered_chunks_per_s": num_chunks / window_s,
            "gateway_cpu_s": cpu_s, "gateway_cpu_us_per_chunk": cpu_s / num_chunks * 1e6,
            "gap_ms_p50": pct(0.5), "gap_ms_p99": pct(0.99), "gap_ms_max": pct(1.0),
            "gap_ms_mean": statistics.fmean(gaps) * 1e3 if gaps else float("nan"),
            "streams_done": num_done}


async def wait_for_replica(port: int, model: str, timeout_s: float = 120.0) -> None:
    """Until the gateway answers a one-token completion (it knows the model and has taken
    this script's stats as a ready replica)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            times = await asyncio.wait_for(_clients(port, model, 1, 1), 5)
            if times[0] and times[0][-1] == -1.0:
                return
        except (OSError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the gateway did not stream within {timeout_s:.0f} s")


async def measure(args) -> dict:
    from cli.stack import Stack, StackOptions, free_port
    from shared.bus import Bus
    from shared.models import resolve_model
    from shared.subjects import Subjects
    from services.gateway.service import load_tokenizer

    model = resolve_model(args.model)
    token_id = load_tokenizer(args.model, "~/.cache/flotilla").encode(
        " the", add_special_tokens=False)[-1]
    port = free_port()
    stack = Stack(StackOptions(model=args.model, port=port, kvstore=False,
                               gateways=args.gateway_workers,
                               log_dir=Path(tempfile.mkdtemp(prefix="flotilla-gwbench-")),
                               service_args={"gateway": args.gateway_args}))
    try:
        stack.nats_url = stack.start_nats()
        bus = await Bus.connect(stack.nats_url, name="gateway-bench")
        scheduler = FakeScheduler(bus, Subjects("flotilla"), args.step_ms / 1000, token_id)
        await scheduler.start()
        background = [asyncio.create_task(scheduler.stats_loop(model.name)),
                      asyncio.create_task(scheduler.step_loop())]
        gateways = [name for name in stack.service_names() if name.startswith("gateway")]
        for name in ["tokenizer", *gateways]:
            stack.start_service(name)
        for _ in gateways:  # (a connection reaches any one of them)
            await wait_for_replica(port, model.name)
        await asyncio.sleep(1.0)  # every gateway has taken a stats message
        pids = [stack.processes[name].pid for name in gateways]
        gateway_pid = pids[0]
        queue = multiprocessing.get_context("spawn").Queue()
        clients = multiprocessing.get_context("spawn").Process(
            target=client_process, args=(port, model.name, args.streams, args.tokens, queue))
        spy = profile(gateway_pid, args.profile) if args.profile else None
        cpu_before, started = sum(map(cpu_seconds, pids)), time.monotonic()
        clients.start()
        times = await asyncio.to_thread(queue.get, True, args.tokens * args.step_ms / 1000 * 5 + 60)
        window_s = time.monotonic() - started
        cpu_s = sum(map(cpu_seconds, pids)) - cpu_before
        await asyncio.to_thread(clients.join, 10)
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its file
            await asyncio.to_thread(spy.wait, 30)
        for task in background:
            task.cancel()
        await bus.close()
    finally:
        stack.stop()
    return summarize(times, cpu_s, window_s, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--tokens", type=int, default=100, help="chunks per stream")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--gateway-args", type=lambda s: s.split(), default=[])
    parser.add_argument("--gateway-workers", type=int, default=1,
                        help="gateway processes on the port (SO_REUSEPORT)")
    parser.add_argument("--profile", default="", help="py-spy flame graph of the gateway "
                        "(SVG; `--format raw` collapsed stacks if the name ends in .txt)")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gateway_streams.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
