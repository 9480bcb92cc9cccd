"""Issue 53: GPU time of Qwen2.5-VL's vision tower (services/worker/qwen_vision.py) on a model
directory's vision config with random weights, per image of ``--size`` pixels square (resized
as the processor does: a grid of 14-pixel patches in 28-pixel merge blocks), for images one
tower call each and ``--batches`` images in one call (the worker's batching of a step's
images), against transformers' ``visual`` (SDPA) on the same weights and the same batch
(its time, and the relative error between the two outputs: the bf16 GPU path's check).

    python -m benchmarks.gpu.vision_encoder --model .devmodels/dummy-qwen2.5-vl-7b \\
        [--size 640] [--batches 1,4,8,16] [--no-hf]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.gpu.common import device_name, save
from services.worker.qwen_images import random_tower_tensors
from services.worker.qwen_vision import QwenVisionSpec, QwenVisionTower, build_tower
from shared.models import resolve_model


def grid_of(size: int, spec: QwenVisionSpec) -> tuple[int, int, int]:
    """The processor's grid for a square image (smart_resize: the nearest multiple of the
    merge block's pixels)."""
    factor = spec.patch_size * spec.merge_size
    side = max(factor, round(size / factor) * factor) // spec.patch_size
    return 1, side, side


def median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hf_visual(config: dict, tensors: dict[str, torch.Tensor]):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel)
    vision = Qwen2_5_VLConfig(**config).vision_config
    vision._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen2_5_VisionTransformerPretrainedModel(vision).to(torch.bfloat16)
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def profile(tower: QwenVisionTower, grid: tuple[int, int, int], num_patches: int,
            batch: int, patch_dim: int) -> None:
    """The GPU kernels of one batched call, by total time."""
    pixels = torch.randn(batch * num_patches, patch_dim, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        tower.encode(pixels, [grid] * batch)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            tower.encode(pixels, [grid] * batch)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=".devmodels/dummy-qwen2.5-vl-7b")
    parser.add_argument("--size", type=int, default=640)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--profile", type=int, default=0,
                        help="images of one batched call to profile (kernel time table)")
    args = parser.parse_args()
    model_files = resolve_model(args.model)
    spec = QwenVisionSpec.from_dict(model_files.config)
    device, dtype = torch.device("cuda"), torch.bfloat16
    tensors = random_tower_tensors(spec, device, dtype)
    tower = build_tower(spec, tensors)
    hf = None if args.no_hf else hf_visual(model_files.config, tensors)
    grid = grid_of(args.size, spec)
    num_patches = grid[0] * grid[1] * grid[2]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        pixels = torch.randn(batch * num_patches, spec.patch_dim, device=device, dtype=dtype)
        with torch.inference_mode():
            batched = median_ms(lambda: tower.encode(pixels, [grid] * batch), args.repeats)
            one_by_one = median_ms(lambda: [tower(p, grid) for p in pixels.split(num_patches)],
                                   args.repeats)
            row = {"images": batch, "batched_ms": round(batched, 2),
                   "batched_ms_per_image": round(batched / batch, 2),
                   "one_call_each_ms_per_image": round(one_by_one / batch, 2)}
            if hf is not None:
                grids = torch.tensor([grid] * batch, device=device)
                hf_ms = median_ms(lambda: hf(pixels, grid_thw=grids), args.repeats)
                row["transformers_ms_per_image"] = round(hf_ms / batch, 2)
                ours = torch.cat(tower.encode(pixels, [grid] * batch)).float()
                theirs = hf(pixels, grid_thw=grids).pooler_output.float()
                row["rel_err_vs_transformers"] = float((ours - theirs).norm() / theirs.norm())
        rows.append(row)
        print(row, flush=True)
    if args.profile:
        profile(tower, grid, num_patches, args.profile, spec.patch_dim)
    save(f"vision-encoder-{args.size}", {
        "device": device_name(), "model": model_files.name, "image_pixels": args.size,
        "grid_thw": grid, "tokens_per_image": num_patches // spec.merge_size ** 2,
        "depth": spec.depth, "hidden_size": spec.hidden_size, "rows": rows})


if __name__ == "__main__":
    main()
