"""Speculative decoding on the CPU through ``flotilla serve`` (issue 28): n-gram drafts
against the same stack without them, SmolLM2-135M-Instruct fp32, greedy chats.

    python -m benchmarks.speculative_cpu [--spec '{"method": "ngram", "num_speculative_tokens": 4}']

Two workloads, each on a stack without speculation and then on one with it (one stack at a
time, so they never share the two cores):

- ``copy``: copy-heavy chats one at a time (repeat a paragraph, copy a list, rewrite code
  with a rename): decode tokens per second after the first token, summed over the chats;
  the texts must be identical.
- ``mixed``: 64 varied chats at once: completion tokens per second of the whole batch.

Results: $OUT/speculative_cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


async def workloads(base_url: str, model: str, args) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await chat(client, model, "Hi.", 4)  # warm-up
        copies = [await chat(client, model, text, args.copy_tokens) for text in COPY_CHATS]
        started = time.perf_counter()
        mixed = await asyncio.gather(*(chat(client, model, text, args.mixed_tokens)
                                       for text in MIXED_CHATS))
        mixed_s = time.perf_counter() - started
    decode_s = sum(c["latency_s"] - c["ttft_s"] for c in copies)
    return {"copy_decode_tok_s": sum(c["tokens"] - 1 for c in copies) / decode_s,
            "copy": copies, "mixed_tok_s": sum(m["tokens"] for m in mixed) / mixed_s,
            "mixed_texts": [m["text"] for m in mixed]}


def run_stack(spec: str, args) -> dict:
    from cli.stack import Stack, StackOptions, free_port
    from shared.models import resolve_model

    scheduler = ["--speculative-config", spec] if spec else []
    stack = Stack(StackOptions(model=args.model, port=free_port(), kvstore=False,
                               log_dir=Path(tempfile.mkdtemp(prefix="flotilla-spec-")),
                               service_args={"scheduler": scheduler}))
    stack.start(timeout_s=300)
    try:
        result = asyncio.run(workloads(stack.base_url, resolve_model(args.model).name, args))
        time.sleep(1.2)  # the schedulers' stats (every 0.5 s) reach the gateway's /metrics
        result["drafts"] = {name: metric(stack.base_url, f"flotilla_spec_decode_{name}_total")
                            for name in ("draft_tokens", "accepted_tokens")}
        return result
    finally:
        stack.stop()


def metric(base_url: str, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as response:
        return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                   if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default=NGRAM, help="the --speculative-config to measure")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--copy-tokens", type=int, default=160)
    parser.add_argument("--mixed-tokens", type=int, default=48)
    args = parser.parse_args()
    off, on = run_stack("", args), run_stack(args.spec, args)
    result = {"spec": args.spec,
              "copy_speedup": on["copy_decode_tok_s"] / off["copy_decode_tok_s"],
              "mixed_ratio": on["mixed_tok_s"] / off["mixed_tok_s"],
              "copy_texts_identical": [a["text"] for a in off["copy"]] == [b["text"] for b in on["copy"]],
              "mixed_texts_identical": off["mixed_texts"] == on["mixed_texts"],
              "off": off, "on": on}
    print(f"copy-heavy, batch 1: {off['copy_decode_tok_s']:.1f} -> {on['copy_decode_tok_s']:.1f} "
          f"decode tok/s ({result['copy_speedup']:.2f}x), texts identical "
          f"{result['copy_texts_identical']}")
    print(f"drafts kept: {on['drafts']['accepted_tokens']:.0f} of {on['drafts']['draft_tokens']:.0f}")
    print(f"64 mixed chats at once: {off['mixed_tok_s']:.1f} -> {on['mixed_tok_s']:.1f} tok/s "
          f"({result['mixed_ratio']:.2f}x), texts identical {result['mixed_texts_identical']}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "speculative_cpu.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
