"""Flags to prompts and request settings, shared by the bench subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import random
from pathlib import Path

from cli.bench.client import RequestSettings
from cli.bench.datasets import BenchRequest, DatasetError, random_requests, shared_prefix_requests
from cli.bench import options, sharegpt
from cli.bench.images import with_images

DEFAULT_OUTPUT_LEN = 128


WARMUP_INPUT_LEN = 16
WARMUP_OUTPUT_LEN = 4
_WARMUP_SEED_OFFSET = 1_000_003  # far from any --seed a sweep or iteration adds to


def build_requests(args: argparse.Namespace, tokenizer, seed: int) -> list[BenchRequest]:
    """The dataset's prompts for one run, with ``--images-per-request`` images each (chat
    image parts: images.py). Each run of a sweep (and each latency iteration) passes its
    own seed: a server with a prefix cache would otherwise serve a repeated prompt's
    prefill from the cache."""
    return with_images(_dataset_requests(args, tokenizer, seed),
                       getattr(args, "images_per_request", 0),
                       getattr(args, "image_size", "640x640"), seed)


def _dataset_requests(args: argparse.Namespace, tokenizer, seed: int) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise DatasetError("--num-prompts must be at least 1")
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.input_len, output_len,
                               args.range_ratio, seed)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(tokenizer, args.num_prompts, args.shared_prefix_groups,
                                      args.shared_prefix_len, args.shared_prefix_suffix_len,
                                      output_len, seed)
    path = Path(args.dataset_path) if args.dataset_path else sharegpt.default_path()
    return sharegpt.sharegpt_requests(tokenizer, sharegpt.load_exchanges(path), args.num_prompts,
                                      seed, fixed_output_len=args.output_len)


def warmup_requests(tokenizer, num_warmups: int, seed: int) -> list[BenchRequest]:
    """Short prompts of their own, so warming up puts nothing the run will ask for into
    a prefix cache."""
    return random_requests(tokenizer, max(num_warmups, 1), WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN,
                           seed=seed + _WARMUP_SEED_OFFSET)


def request_settings(args: argparse.Namespace, model_name: str,
                     ignore_eos: bool | None = None) -> RequestSettings:
    return RequestSettings(model=model_name, endpoint=options.endpoint(args),
                           temperature=args.temperature,
                           ignore_eos=args.ignore_eos if ignore_eos is None else ignore_eos,
                           per_chunk_usage=args.per_chunk_usage,
                           timed_chunks=args.timed_chunks,
                           extra_body=args.extra_body)


def assign_adapters(requests: list[BenchRequest], lora_names: list[str], assignment: str,
                    seed: int) -> list[BenchRequest]:
    """The requests spread over LoRA adapters (``--lora-modules``): ``round-robin`` in
    turn, ``random`` uniformly with the run's seed; unchanged without adapters."""
    if not lora_names:
        return requests
    rng = random.Random(seed)
    return [dataclasses.replace(request, model=lora_names[index % len(lora_names)]
                                if assignment == "round-robin" else rng.choice(lora_names))
            for index, request in enumerate(requests)]


def dataset_settings(args: argparse.Namespace, requests: list[BenchRequest]) -> dict:
    """What the prompts were, for the result JSON."""
    prompt_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    return {"dataset_name": args.dataset_name, "num_prompts": len(requests),
            "prompt_len_min": min(prompt_lens), "prompt_len_max": max(prompt_lens),
            "total_prompt_tokens": sum(prompt_lens),
            "output_len_min": min(output_lens), "output_len_max": max(output_lens),
            "total_output_tokens_requested": sum(output_lens)}
