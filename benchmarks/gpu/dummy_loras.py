"""Random PEFT LoRA adapters for a model directory's config, to measure LoRA serving on dummy
weights (issue 50: 8 adapters of rank 16 on all seven projections of Llama-3.1-8B).

    python -m benchmarks.gpu.dummy_loras --model .devmodels/dummy-llama-3.1-8b --num 8 \\
        --rank 16 --out /tmp/loras

Writes OUT/lora0 .. OUT/lora{N-1}, each PEFT's two files (adapter_config.json,
adapter_model.safetensors in bf16: ~84 MB an adapter at the 8B's shapes and rank 16), and
prints the ``--lora-modules`` value naming them. A: N(0, 1/in_features), B: N(0, B_STD^2),
alpha 2r: deltas small next to the projections' outputs but far from zero (PEFT's default
initialization has B = 0, which adds nothing). Written where the benchmark runs (the device
machine), never committed. An MoE model's adapters target attention only (its experts take
none, as the worker checks).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.worker.lora import base_shapes
from services.worker.model_config import ModelConfig
from shared.lora_adapters import CONFIG_FILE, TARGETS, TENSORS_FILE, tensor_name
from shared.models import resolve_model

B_STD = 0.02


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int, base_path: str,
                  b_std: float = B_STD) -> None:
    """One adapter of ``rank`` on every projection the base model can take, in ``path``."""
    parts = base_shapes(config, rank).part_shapes  # part -> [out_features, in_features]
    targets = [part for part in TARGETS if part in parts]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for part in targets:
            out_features, in_features = parts[part]
            lora_a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            lora_b = torch.randn(out_features, rank, generator=generator) * b_std
            tensors[tensor_name(layer, part, "lora_A")] = lora_a.to(torch.bfloat16)
            tensors[tensor_name(layer, part, "lora_B")] = lora_b.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / TENSORS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "use_rslora": False,
        "bias": "none", "target_modules": targets}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a model directory (or dummy:<preset>)")
    parser.add_argument("--num", type=int, default=8, help="adapters to write")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default="/tmp/loras")
    args = parser.parse_args()
    model_path = resolve_model(args.model).path
    config = ModelConfig.from_path(Path(model_path))
    out = Path(args.out)
    names = [f"lora{i}" for i in range(args.num)]
    for seed, name in enumerate(names):
        write_adapter(out / name, config, args.rank, seed, str(model_path))
    print(",".join(f"{name}={out / name}" for name in names))


if __name__ == "__main__":
    main()
