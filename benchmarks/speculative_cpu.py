"""Speculative decoding on the CPU through ``flotilla serve`` (issue 28): n-gram drafts
against the same stack without them, SmolLM2-135M-Instruct fp32, greedy chats.

    python -m benchmarks.speculative_cpu [--spec '{"method": "ngram", "num_speculative_tokens": 4}']

Two workloads, each on a stack without speculation and then on one with it (one stack at a
time, so they never share the two cores), in ``--pairs`` alternating pairs (the 2-core
machine's timings vary by ±15% from run to run); the ratios reported are the medians of
the pairs':

- ``copy``: copy-heavy chats one at a time (repeat a paragraph, copy a list, rewrite code
  with a rename): decode tokens per second after the first token, summed over the chats;
  the texts must be identical.
- ``chat``: ``--chats`` of the varied chats one at a time (batch 1), measured as ``copy``.
- ``mixed``: 64 varied chats at once: completion tokens per second of the whole batch.

Each workload's mean acceptance length (tokens a verify step gives: 1 + kept drafts per
drafted step, vLLM's measure) comes from the gateway's draft counters before and after it.
``--spec '{"method": "eagle3", "model": "trained", ...}'`` drafts with the SmolLM2 EAGLE-3
head ``benchmarks/eagle_train.py`` trains (made on first use, cached; its ``--prompts`` and
``--epochs`` as ``--head-prompts`` and ``--head-epochs``).

Results: $OUT/speculative_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out"))
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
PARAGRAPH = ("The harbour opens at six. Boats leave from the north pier in summer and from the "
             "south pier in winter. Tickets are sold on board, cash only.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = sum(item.price for item in items)\n"
        "    tax = subtotal * tax_rate\n    return subtotal + tax\n")
COPY_CHATS = [
    f"Repeat this paragraph word for word: {PARAGRAPH}",
    "Copy this list exactly, one item per line: flour, sugar, eggs, butter, milk, salt, "
    "yeast, honey, vanilla, cinnamon.",
    f"Rewrite this code, renaming total_price to order_total:\n{CODE}",
    f"Repeat exactly, twice: {PARAGRAPH}",
    "Copy this line three times: the quick brown fox jumps over the lazy dog",
    f"Rewrite this code with tax_rate renamed to vat:\n{CODE}",
]
TOPICS = ["the moon", "bread", "rivers", "chess", "bees", "glass", "trains", "tea", "maps",
          "clocks", "salt", "kites", "owls", "rain", "paper", "bridges"]
MIXED_CHATS = [f"{verb} {topic}." for verb in ("Tell me about", "Write a haiku about",
                                               "Give three facts about", "Explain")
               for topic in TOPICS]


async def chat(client, model: str, text: str, max_tokens: int) -> dict:
    """One streamed greedy chat: text, completion tokens, TTFT and latency (seconds)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0.0, "stream_options": {"include_usage": True}}
    started, first, parts, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            for choice in payload.get("choices") or []:
                if content := choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(content)
            usage = payload.get("usage") or usage
    return {"text": "".join(parts), "tokens": usage["completion_tokens"],
            "ttft_s": (first or time.perf_counter()) - started,
            "latency_s": time.perf_counter() - started}


DRAFT_COUNTERS = ("draft_tokens", "accepted_tokens", "drafts")


def draft_counts(base_url: str) -> dict:
    time.sleep(1.2)  # the schedulers' stats (every 0.5 s) reach the gateway's /metrics
    return {name: metric(base_url, f"flotilla_spec_decode_{name}_total")
            for name in DRAFT_COUNTERS}


def acceptance(before: dict, after: dict) -> dict:
    """A workload's drafts: kept of proposed, and the mean acceptance length (tokens per
    verify step: 1 + kept drafts per drafted step; None: nothing drafted)."""
    delta = {name: after[name] - before[name] for name in DRAFT_COUNTERS}
    steps = delta["drafts"]
    delta["mean_acceptance_length"] = 1 + delta["accepted_tokens"] / steps if steps else None
    return delta


def decode_tok_s(chats: list[dict]) -> float:
    return sum(c["tokens"] - 1 for c in chats) / sum(c["latency_s"] - c["ttft_s"] for c in chats)


async def workloads(base_url: str, model: str, args) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await chat(client, model, "Hi.", 4)  # warm-up
        counts = [draft_counts(base_url)]
        copies = [await chat(client, model, text, args.copy_tokens) for text in COPY_CHATS]
        counts.append(draft_counts(base_url))
        chats = [await chat(client, model, text, args.mixed_tokens)
                 for text in MIXED_CHATS[::len(MIXED_CHATS) // args.chats][:args.chats]]
        counts.append(draft_counts(base_url))
        started = time.perf_counter()
        mixed = await asyncio.gather(*(chat(client, model, text, args.mixed_tokens)
                                       for text in MIXED_CHATS))
        mixed_s = time.perf_counter() - started
        counts.append(draft_counts(base_url))
    return {"copy_decode_tok_s": decode_tok_s(copies), "copy": copies,
            "chat_decode_tok_s": decode_tok_s(chats), "chat": chats,
            "mixed_tok_s": sum(m["tokens"] for m in mixed) / mixed_s,
            "mixed_texts": [m["text"] for m in mixed],
            "drafts": {name: acceptance(a, b) for name, a, b in zip(
                ("copy", "chat", "mixed"), counts, counts[1:])}}


def run_stack(spec: str, args) -> dict:
    from cli.stack import Stack, StackOptions, free_port
    from shared.models import resolve_model
    from shared.sections.speculative import WORKER_METHODS

    scheduler = ["--speculative-config", spec] if spec else []
    # the worker too where it drafts (a draft model, an EAGLE head), as flotilla serve does
    worker = scheduler if spec and json.loads(spec).get("method") in WORKER_METHODS else []
    stack = Stack(StackOptions(model=args.model, port=free_port(), kvstore=False,
                               log_dir=Path(tempfile.mkdtemp(prefix="flotilla-spec-")),
                               service_args={"scheduler": scheduler, "worker": worker}))
    stack.start(timeout_s=300)
    try:
        return asyncio.run(workloads(stack.base_url, resolve_model(args.model).name, args))
    finally:
        stack.stop()


def metric(base_url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as response:
        return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                   if line.startswith(name + "{"))


def pair(off: dict, on: dict) -> dict:
    """One off/on pair: the ratios, and whether every text is the same."""
    same = all([a["text"] for a in off[set_]] == [b["text"] for b in on[set_]]
               for set_ in ("copy", "chat")) and off["mixed_texts"] == on["mixed_texts"]
    return {"copy_speedup": on["copy_decode_tok_s"] / off["copy_decode_tok_s"],
            "chat_speedup": on["chat_decode_tok_s"] / off["chat_decode_tok_s"],
            "mixed_ratio": on["mixed_tok_s"] / off["mixed_tok_s"], "texts_identical": same,
            "off": off, "on": on}


def _lengths(drafts: dict) -> str:
    return ", ".join(f"{name} {d['mean_acceptance_length'] or 1.0:.2f}"
                     for name, d in drafts.items())


def trained_head_spec(args) -> str:
    """``"model": "trained"`` with method eagle3: the head eagle_train.py makes (cached)."""
    spec = json.loads(args.spec)
    if spec.get("method") != "eagle3" or spec.get("model") != "trained":
        return args.spec
    from benchmarks.eagle_train import TrainOptions, ensure_head

    changes = {name: value for name, value in (("prompts", args.head_prompts),
                                               ("epochs", args.head_epochs)) if value}
    spec["model"] = str(ensure_head(TrainOptions(**changes)))
    return json.dumps(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=NGRAM, help="the --speculative-config to measure")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--copy-tokens", type=int, default=160)
    parser.add_argument("--mixed-tokens", type=int, default=48)
    parser.add_argument("--chats", type=int, default=16, help="chats of the batch-1 chat set")
    parser.add_argument("--pairs", type=int, default=3, help="off/on pairs, alternating")
    parser.add_argument("--head-prompts", type=int, default=None)
    parser.add_argument("--head-epochs", type=int, default=None)
    args = parser.parse_args()
    args.spec = trained_head_spec(args)
    pairs = [pair(run_stack("", args), run_stack(args.spec, args)) for _ in range(args.pairs)]
    result = {"spec": args.spec, "pairs": pairs,
              "copy_speedup": statistics.median(p["copy_speedup"] for p in pairs),
              "chat_speedup": statistics.median(p["chat_speedup"] for p in pairs),
              "mean_acceptance_length": {set_: statistics.median(
                  p["on"]["drafts"][set_]["mean_acceptance_length"] or 1.0 for p in pairs)
                  for set_ in ("copy", "chat", "mixed")},
              "mixed_ratio": statistics.median(p["mixed_ratio"] for p in pairs),
              "texts_identical": all(p["texts_identical"] for p in pairs)}
    for p in pairs:
        print(f"copy-heavy, batch 1: {p['off']['copy_decode_tok_s']:.1f} -> "
              f"{p['on']['copy_decode_tok_s']:.1f} decode tok/s ({p['copy_speedup']:.2f}x); "
              f"64 mixed at once: {p['off']['mixed_tok_s']:.1f} -> {p['on']['mixed_tok_s']:.1f} "
              f"tok/s ({p['mixed_ratio']:.2f}x); chat, batch 1: {p['off']['chat_decode_tok_s']:.1f}"
              f" -> {p['on']['chat_decode_tok_s']:.1f} ({p['chat_speedup']:.2f}x); acceptance "
              f"length {_lengths(p['on']['drafts'])}; texts identical {p['texts_identical']}")
    print(f"medians: copy {result['copy_speedup']:.2f}x, chat {result['chat_speedup']:.2f}x, "
          f"mixed {result['mixed_ratio']:.2f}x; mean acceptance length "
          f"{result['mean_acceptance_length']}; every text identical: {result['texts_identical']}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "speculative_cpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
