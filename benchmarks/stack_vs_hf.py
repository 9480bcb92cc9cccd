"""16 concurrent requests through the flotilla stack vs Hugging Face generate() with a
static batch of 16, on the same prompts, same machine, same run.

    .venv/bin/python -m benchmarks.stack_vs_hf [--num-requests 16] [--output-len 64]

Starts its own stack (nats-server + services on free ports) unless --base-url is given.
Both sides produce exactly --output-len tokens per request (ignore_eos / min_new_tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli.stack import Stack, StackOptions, free_port
from shared.models import resolve_model

QUESTIONS = [
    "What is the capital of France?", "Write a poem about autumn leaves.",
    "Explain how a bicycle works.", "Give three tips for learning a language.",
    "What causes the seasons on Earth?", "Describe a busy market in the morning.",
    "How do vaccines work?", "Summarise the plot of Romeo and Juliet.",
    "Why do cats purr?", "What is a black hole?", "Suggest a name for a bakery.",
    "How is paper made?", "What is the difference between weather and climate?",
    "Write a short story opening about a lighthouse.", "How do bees make honey?",
    "List some uses of copper.",
]


def build_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    return [tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"] for i in range(num_requests)]


async def run_stack(base_url: str, model: str, prompts: list[list[int]], output_len: int) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(prompt_ids: list[int]) -> int:
            response = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt_ids, "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True})
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        await one(prompts[0])  # warm-up
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - started
    return {"output_tokens": sum(counts), "seconds": elapsed}


def run_hf(model_path: Path, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(batch: list[list[int]]) -> int:
        padded = tokenizer.pad({"input_ids": batch}, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**padded, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=pad_id)
        return (out.shape[1] - padded["input_ids"].shape[1]) * len(batch)

    generate(prompts[:2])  # warm-up
    started = time.perf_counter()
    total = sum(generate(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size))
    return {"output_tokens": total, "seconds": time.perf_counter() - started}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--base-url", default=None, help="use a running stack")
    args = parser.parse_args()

    model_files = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_files.path))
    prompts = build_prompts(tokenizer, args.num_requests)
    stack = None
    base_url = args.base_url
    if base_url is None:
        stack = Stack(StackOptions(model=args.model, host="127.0.0.1", port=free_port(),
                                   log_dir=Path(tempfile.mkdtemp(prefix="flotilla-bench-"))))
        stack.start()
        base_url = stack.base_url
    try:
        ours = asyncio.run(run_stack(base_url, model_files.name, prompts, args.output_len))
    finally:
        if stack is not None:
            stack.stop()
    hf = run_hf(model_files.path, prompts, args.output_len, args.hf_batch_size)

    ours_tps = ours["output_tokens"] / ours["seconds"]
    hf_tps = hf["output_tokens"] / hf["seconds"]
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}")
    print(f"workload: {args.num_requests} requests, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.output_len} new tokens each, greedy")
    print(f"flotilla stack : {ours['output_tokens']} tokens in {ours['seconds']:.2f} s "
          f"= {ours_tps:.1f} output tok/s")
    print(f"HF generate    : {hf['output_tokens']} tokens in {hf['seconds']:.2f} s "
          f"= {hf_tps:.1f} output tok/s (static batch {args.hf_batch_size})")
    print(f"ratio flotilla/HF: {ours_tps / hf_tps:.2f}")


if __name__ == "__main__":
    main()
