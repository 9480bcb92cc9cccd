"""Issue 4 acceptance: bf16 logprobs of a real-size architecture against transformers on the
same random weights, on the GPU.

    python -m benchmarks.gpu.parity --model dummy:llama-3.1-8b --num-tokens 512

transformers builds the architecture with its own random initialisation on the GPU; its weights
are copied into flotilla's model (q/k/v and gate/up fused as the loader does); both then score
the same --num-tokens random tokens as one prompt (flotilla over its paged cache, in two chunks so
the second reads the first from the cache) and the log-softmax at every position is compared.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.gpu.common import device_name, hf_random_model, save
from services.worker.weights import fuse_hf_weights, load_model
from services.worker.runner import SequenceChunk, build_step_inputs
from kernels.paged_attention_ref import allocate_kv_cache
from shared.models import resolve_model

BLOCK_SIZE = 16


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--num-tokens", type=int, default=512)
    args = parser.parse_args()
    model_files = resolve_model(args.model)
    hf_model = hf_random_model(model_files)
    ours = load_model(model_files.path, torch.device("cuda"), torch.bfloat16)
    ours.load_state_dict(fuse_hf_weights(dict(hf_model.state_dict()), ours.config), strict=True)
    config = ours.config
    num_blocks = -(-args.num_tokens // BLOCK_SIZE)
    ours.bind_kv_cache(allocate_kv_cache(config.num_layers, num_blocks, BLOCK_SIZE,
                                         config.num_kv_heads, config.head_dim, torch.bfloat16,
                                         "cuda"))
    token_ids = torch.randint(100, 40_000, (args.num_tokens,),
                              generator=torch.Generator().manual_seed(0)).tolist()
    block_table = list(range(num_blocks))
    half = args.num_tokens // 2 + 3  # the second chunk starts mid-block
    logits = []
    for start, end in ((0, half), (half, args.num_tokens)):
        chunk = SequenceChunk(token_ids=token_ids[start:end], start=start,
                              block_table=block_table, sample=True)
        input_ids, positions, metadata = build_step_inputs([chunk], BLOCK_SIZE,
                                                           torch.device("cuda"))
        metadata = dataclasses.replace(metadata, logits_indices=torch.arange(
            end - start, device="cuda"))
        logits.append(ours(input_ids, positions, metadata))
    ours_logprobs = torch.cat(logits).float().log_softmax(-1)  # [num_tokens, vocab]
    hf_logits = hf_model(torch.tensor([token_ids], device="cuda")).logits[0]
    hf_logprobs = hf_logits.float().log_softmax(-1)  # [num_tokens, vocab]
    # The same weights in fp32 through transformers: how far each bf16 run is from exact.
    exact_logprobs = hf_model.float()(torch.tensor([token_ids], device="cuda")).logits[0]
    exact_logprobs = exact_logprobs.log_softmax(-1)  # [num_tokens, vocab]
    ours_error = (ours_logprobs - exact_logprobs).abs()
    hf_error = (hf_logprobs - exact_logprobs).abs()
    diff = (ours_logprobs - hf_logprobs).abs()
    hf_top = hf_logprobs.argmax(-1)
    top_diff = diff.gather(-1, hf_top[:, None])
    result = {"benchmark": "parity", "model": args.model, "device": device_name(),
              "num_tokens": args.num_tokens, "max_abs_logprob_diff": float(diff.max()),
              "mean_abs_logprob_diff": float(diff.mean()),
              "max_abs_diff_at_hf_top": float(top_diff.max()),
              "top1_agreement": float((ours_logprobs.argmax(-1) == hf_top).float().mean()),
              "hf_top_logprob_mean": float(hf_logprobs.max(-1).values.mean()),
              "ours_bf16_vs_fp32_mean": float(ours_error.mean()),
              "ours_bf16_vs_fp32_max": float(ours_error.max()),
              "hf_bf16_vs_fp32_mean": float(hf_error.mean()),
              "hf_bf16_vs_fp32_max": float(hf_error.max()),
              "ours_top1_vs_fp32": float((ours_logprobs.argmax(-1) == exact_logprobs.argmax(-1))
                                         .float().mean()),
              "hf_top1_vs_fp32": float((hf_top == exact_logprobs.argmax(-1)).float().mean())}
    save(f"parity_{args.model.replace(':', '_')}", result)
    print(f"\nparity {args.model}: max |dlogprob| {result['max_abs_logprob_diff']:.4f}, mean "
          f"{result['mean_abs_logprob_diff']:.5f}, top-1 agreement {result['top1_agreement']:.3f}; "
          f"vs fp32: ours mean {result['ours_bf16_vs_fp32_mean']:.5f}, HF bf16 mean "
          f"{result['hf_bf16_vs_fp32_mean']:.5f}")


if __name__ == "__main__":
    main()
