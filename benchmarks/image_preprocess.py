"""Issue 53: the tokenizer tier's work on one image (services/tokenizer/qwen_images.py:
transformers' Qwen2VLImageProcessor, the placeholders, the codes and their table), one thread
and one core, and the bytes the image takes to the worker.

    OMP_NUM_THREADS=1 python -m benchmarks.image_preprocess [--model dummy:qwen2.5-vl-7b] \\
        [--size 640] [--repeats 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from PIL import Image
from transformers import AutoTokenizer

from services.tokenizer.qwen_images import QwenImagePrompts
from shared.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:qwen2.5-vl-7b")
    parser.add_argument("--size", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    path = resolve_model(args.model).path
    prompts = QwenImagePrompts(path, AutoTokenizer.from_pretrained(str(path)))
    rng = np.random.default_rng(0)
    times_ms = []
    for _ in range(args.repeats + 2):  # (the first two warm up)
        pixels = rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
        start = time.perf_counter()
        _, (image,) = prompts.encode("<|image_pad|>", [Image.fromarray(pixels)])
        times_ms.append((time.perf_counter() - start) * 1000)
    timed = times_ms[2:]
    print(f"{args.size}x{args.size}: median {statistics.median(timed):.1f} ms (min "
          f"{min(timed):.1f}, max {max(timed):.1f}) over {len(timed)}; "
          f"{len(image.pixels) + len(image.pixel_table):,} bytes to the worker; grid "
          f"{list(image.grid_thw)}, {image.length} tokens")


if __name__ == "__main__":
    main()
