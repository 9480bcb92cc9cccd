"""The Hugging Face ``transformers`` peer: ``generate()`` on the same prompts, in static
batches padded on the left, greedy."""

from __future__ import annotations

import time
from pathlib import Path

from cli.bench.datasets import BenchRequest


def useful_tokens(new_ids: list[int], output_len: int, eos_id: int | None,
                  ignore_eos: bool) -> int:
    """Tokens a row really produced for its request: up to and including its first EOS
    (unless EOS is ignored), never more than it asked for. A static batch runs every row
    to the batch's longest request; the extra tokens are waste, not throughput."""
    if not ignore_eos and eos_id is not None and eos_id in new_ids:
        return min(new_ids.index(eos_id) + 1, output_len)
    return min(len(new_ids), output_len)


def _dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def run_hf(model_path: Path, requests: list[BenchRequest], batch_size: int,
           ignore_eos: bool = True, device: str = "auto", dtype: str = "auto") -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=_dtype(dtype, device))
    model = model.to(device).eval()
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id

    def generate(batch: list[BenchRequest], max_new: int) -> list[list[int]]:
        padded = tokenizer.pad({"input_ids": [r.prompt_ids for r in batch]},
                               return_tensors="pt").to(device)
        with torch.inference_mode():
            out = model.generate(**padded, max_new_tokens=max_new, do_sample=False,
                                 min_new_tokens=max_new if ignore_eos else 0, pad_token_id=pad_id)
        return out[:, padded["input_ids"].shape[1]:].tolist()  # [batch, new tokens]

    generate(requests[:batch_size], 2)  # warm-up: allocator, kernels
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    num_output_tokens = 0
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        rows = generate(batch, max(r.output_len for r in batch))
        num_output_tokens += sum(useful_tokens(row, r.output_len, eos_id, ignore_eos)
                                 for row, r in zip(rows, batch))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    duration_s = time.perf_counter() - started
    num_input_tokens = sum(r.prompt_len for r in requests)
    return {"completed": len(requests), "failed": 0, "duration_s": duration_s,
            "total_input_tokens": num_input_tokens, "total_output_tokens": num_output_tokens,
            "request_throughput": len(requests) / duration_s,
            "input_throughput": num_input_tokens / duration_s,
            "output_throughput": num_output_tokens / duration_s,
            "total_token_throughput": (num_input_tokens + num_output_tokens) / duration_s,
            "batch_size": batch_size, "device": device, "dtype": str(model.dtype),
            "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__}
