"""Train an EAGLE-3 head for the default model (issue 52), on its own greedy replies to
ShareGPT prompts (benchmarks/eagle_data.py), and write it in the public checkpoints' layout
(services/worker/eagle_head.py) for ``--speculative-config '{"method": "eagle3", "model":
DIR}'``.

    python -m benchmarks.eagle_train [--prompts 2048] [--epochs 4]   # prints DIR
    python -m benchmarks.eagle_train --device cuda --prompts 8192     # on a GPU: minutes

Made on first use and cached like the default model's conversion: the head goes to
``<cache_dir>/models/eagle3-SmolLM2-135M-Instruct-<key>/`` (the key: the settings, the served
model's directory and this code's version), built in a staging directory under a file lock,
so a second call returns at once; the replies and hidden states are kept beside it
(``eagle-data-<key>.pt``) so training again with other settings skips the generation.

The head: EAGLE-3's one decoder layer over fc(concat(h_2, h_15, h_27)) and the next token's
embedding (the served model's, frozen), its own norm and lm_head over the
``--draft-vocab`` most frequent target tokens of the data (``d2t``/``t2d``), the lm_head
started from those tokens' embeddings. Training-time test (EAGLE-3's): step j feeds row i
the output feature of step j - 1 at row i - 1, as drafting feeds pass j + 1 the output of
pass j, and attends to the target-fed keys up to position i - j and to its own chain's
keys after them; every step predicts the served model's argmax, loss weights 0.8^j.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

DATA_VERSION = "1"  # the replies and hidden states (eagle_data.py)
TRAIN_VERSION = "2"  # the training (2: padded batches, a held-out set)


@dataclass(frozen=True)
class TrainOptions:
    # (2,048: ~40 min of replies and hidden states and ~18 min of training on two cores;
    # 1,024 overfit by epoch 4, held-out accuracy 0.44 against 0.52 with 2,048)
    prompts: int = 2048
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    draft_vocab: int = 4096
    epochs: int = 4
    ttt_steps: int = 3
    lr: float = 1e-3
    batch_size: int = 8  # conversations per optimizer step (one padded batch)
    held_out: int = 32  # the last conversations, not trained on (when there are 4x as many)
    context_tokens: int = 96  # of each prompt, the last ones the head attends to in training
    scored_prompt: int = 16  # of those, the last ones whose predictions count (then the reply)
    seed: int = 0
    device: str = "cpu"  # where the replies, hidden states and training run ("cuda": minutes)


def aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default low, middle and high layers (vLLM's and SpecForge's choice)."""
    return (2, num_layers // 2, num_layers - 3)


class HeadWeights(torch.nn.Module):
    """The head's trainable tensors, named as the public checkpoints name them."""

    def __init__(self, config: dict, draft_vocab: int, embeddings: torch.Tensor,
                 draft_ids: torch.Tensor, final_norm: torch.Tensor) -> None:
        super().__init__()
        hidden, inner = config["hidden_size"], config["intermediate_size"]
        self.num_heads, self.num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.eps = config.get("rms_norm_eps", 1e-5)
        linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = linear(3 * hidden, hidden)
        self.q_proj = linear(2 * hidden, self.num_heads * self.head_dim)
        self.k_proj = linear(2 * hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = linear(2 * hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = linear(self.num_heads * self.head_dim, hidden)
        self.gate_proj, self.up_proj = linear(hidden, inner), linear(hidden, inner)
        self.down_proj = linear(inner, hidden)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(self, name, torch.nn.Parameter(torch.ones(hidden)))
        self.norm = torch.nn.Parameter(final_norm.clone())
        self.lm_head = torch.nn.Parameter(embeddings[draft_ids].clone())  # [draft_vocab, hidden]
        # frozen: the served model's
        self.register_buffer("embeddings", embeddings, persistent=False)
        exponents = torch.arange(0, self.head_dim, 2).float() / self.head_dim
        inv_freq = 1.0 / _rope_theta(config) ** exponents
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, dim] rotated as Llama (halves)."""
        angles = positions[:, None].float() * self.inv_freq[None]  # [T, dim / 2]
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def qkv(self, features: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor):
        """features [B, T, hidden] (one step's), the next tokens [B, T] -> q [B, heads, T,
        dim], k and v [B, heads, T, dim] (kv heads repeated), the residual [B, T, hidden]."""
        embeds = self.rms(self.embeddings[token_ids], self.input_layernorm)
        h = torch.cat([embeds, self.rms(features, self.hidden_norm)], -1)
        batch, count = h.shape[:2]
        split = lambda t, n: t.view(batch, count, n, self.head_dim).transpose(1, 2)  # noqa: E731
        repeat = self.num_heads // self.num_kv_heads
        q = self.rotate(split(self.q_proj(h), self.num_heads), positions)
        k = self.rotate(split(self.k_proj(h), self.num_kv_heads), positions)
        v = split(self.v_proj(h), self.num_kv_heads)
        return q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), features

    def finish(self, attention: torch.Tensor, residual: torch.Tensor, scored: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention [B, heads, T, dim] -> (logits of the ``scored`` [B, T] rows [n,
        draft_vocab], output feature [B, T, hidden])."""
        x = self.o_proj(attention.transpose(1, 2).flatten(2)) + residual
        h = self.rms(x, self.post_attention_layernorm)
        stream = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + x
        return self.rms(stream[scored], self.norm) @ self.lm_head.T, stream


def ttt_loss(head: HeadWeights, aux: torch.Tensor, token_ids: torch.Tensor,
             labels: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A padded batch's loss over ``steps`` chained steps, and each step's (correct,
    scored) counts. aux [B, T + 1, 3 * hidden] (its last row unused), token_ids [B, T + 1],
    labels [B, T]: row i (position i) takes token i + 1 and predicts labels[i] (the draft
    index of the target's argmax at i + 1; -1: not scored: context only, not in the draft
    vocabulary, padding or past the end). Padding sits at the end, so the causal mask keeps it out of real rows."""
    count = token_ids.shape[1] - 1
    positions = torch.arange(count, device=token_ids.device)
    next_ids = token_ids[:, 1:]
    features = head.fc(aux[:, :count])
    scale = head.head_dim ** -0.5
    keys, values = [], []
    total, counts = 0.0, []
    for step in range(steps):
        q, k, v, residual = head.qkv(features, next_ids, positions)
        keys.append(k)
        values.append(v)
        # target-fed keys up to i - step, then the chain's own keys at i - step + s
        scores = [(q @ keys[0].transpose(2, 3)) * scale]
        scores[0] = scores[0].masked_fill(positions[None, :] > positions[:, None] - step,
                                          float("-inf"))
        for s in range(1, step + 1):
            shifted = torch.roll(keys[s], step - s, dims=2)  # row i: key of row i - (step - s)
            scores.append(((q * shifted).sum(-1, keepdim=True) * scale).masked_fill(
                (positions < step - s)[:, None], float("-inf")))
        weights = torch.softmax(torch.cat(scores, -1), -1)
        out = weights[..., :count] @ values[0]
        for s in range(1, step + 1):
            out = out + weights[..., count + s - 1:count + s] * torch.roll(values[s], step - s, 2)
        scored = (labels >= 0) & (positions >= step)[None]  # (rows before step: no chain base)
        logits, stream = head.finish(out, residual, scored)
        target = labels[scored]
        if target.numel():
            total = total + 0.8 ** step * F.cross_entropy(logits, target)
        counts.append((int((logits.argmax(-1) == target).sum()), target.numel()))
        features = torch.cat([torch.zeros_like(stream[:, :1]), stream[:, :-1]], 1)  # i <- i - 1
    return total, counts


def conversation_rows(c, to_draft: torch.Tensor, options: "TrainOptions"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A conversation's training rows: the prompt's last ``context_tokens`` and the reply ->
    (aux [N, 3 * hidden] fp32, token ids [N], labels [N - 1]); labels -1 before the prompt's
    last ``scored_prompt`` rows (context only)."""
    start = max(0, c.prompt_len - options.context_tokens)
    labels = to_draft[c.target_ids[start + 1:]]
    labels[:max(0, c.prompt_len - 1 - start - options.scored_prompt)] = -1
    return c.aux_hidden[start:].float(), c.token_ids[start:], labels


def padded_batches(conversations, to_draft: torch.Tensor, options: "TrainOptions",
                   generator: torch.Generator):
    """An epoch's batches of ``batch_size`` conversations, of similar lengths (shuffled,
    sorted by length in windows of 16 batches, the batches shuffled), padded at the end
    -> (aux [B, T, 3 * hidden], token ids [B, T], labels [B, T - 1])."""
    order = torch.randperm(len(conversations), generator=generator).tolist()
    window = 16 * options.batch_size
    batches = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: len(conversations[i].token_ids))
        batches += [chunk[b:b + options.batch_size]
                    for b in range(0, len(chunk), options.batch_size)]
    for b in torch.randperm(len(batches), generator=generator).tolist():
        rows = [conversation_rows(conversations[i], to_draft, options) for i in batches[b]]
        length = max(len(ids) for _, ids, _ in rows)
        aux = torch.zeros(len(rows), length, rows[0][0].shape[1])
        token_ids = torch.zeros(len(rows), length, dtype=torch.int64)
        labels = torch.full((len(rows), length - 1), -1, dtype=torch.int64)
        for j, (a, ids, lab) in enumerate(rows):
            aux[j, :len(ids)], token_ids[j, :len(ids)], labels[j, :len(lab)] = a, ids, lab
        yield aux, token_ids, labels


def draft_vocabulary(conversations, vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """The ``draft_vocab`` most frequent target tokens, ascending ids [draft_vocab]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for conversation in conversations:
        counts += torch.bincount(conversation.target_ids, minlength=vocab_size)
    return counts.topk(draft_vocab).indices.sort().values


def train_head(model_dir: Path, conversations, options: TrainOptions, log=print) -> dict:
    """-> the head's tensors in the checkpoint's names, and its config.json (``config``)."""
    torch.manual_seed(options.seed)
    config = json.loads((model_dir / "config.json").read_text())
    target = load_file(str(model_dir / "model.safetensors"))
    embeddings = target["model.embed_tokens.weight"].float()
    vocab = config["vocab_size"]
    # the last conversations are held out (when there are enough): accuracy on unseen replies
    num_held = options.held_out if len(conversations) >= 4 * options.held_out else 0
    train = conversations[:len(conversations) - num_held]
    held = conversations[len(conversations) - num_held:]
    draft_ids = draft_vocabulary(train, vocab, options.draft_vocab)
    to_draft = torch.full((vocab,), -1, dtype=torch.int64)
    to_draft[draft_ids] = torch.arange(len(draft_ids))
    head = HeadWeights(config, len(draft_ids), embeddings, draft_ids,
                       target["model.norm.weight"].float()).to(options.device)
    params = [p for p in head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    total_steps = options.epochs * math.ceil(len(train) / options.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    generator = torch.Generator().manual_seed(options.seed)
    started = time.perf_counter()
    for epoch in range(options.epochs):
        sums = [(0, 0)] * options.ttt_steps
        for batch in padded_batches(train, to_draft, options, generator):
            loss, counts = ttt_loss(head, *(t.to(options.device) for t in batch), options.ttt_steps)
            if not isinstance(loss, torch.Tensor):
                continue  # (no row of the batch scored)
            loss.backward()
            sums = [(a + c, b + n) for (a, b), (c, n) in zip(sums, counts)]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        log(f"eagle train: epoch {epoch + 1}/{options.epochs}, accuracy by step "
            f"{_rates(sums)}, held out {_rates(held_accuracy(head, held, to_draft, options))}, "
            f"{time.perf_counter() - started:.0f} s")
    return checkpoint(head, config, draft_ids, options)


@torch.no_grad()
def held_accuracy(head: HeadWeights, held, to_draft: torch.Tensor, options: TrainOptions
                  ) -> list[tuple[int, int]]:
    """Each chained step's (correct, scored) counts over the held-out conversations' replies
    (what drafting serves, whatever ``scored_prompt`` training used)."""
    sums = [(0, 0)] * options.ttt_steps
    generator = torch.Generator().manual_seed(0)
    replies_only = dataclasses.replace(options, scored_prompt=0)
    for batch in padded_batches(held, to_draft, replies_only, generator):
        _, counts = ttt_loss(head, *(t.to(options.device) for t in batch), options.ttt_steps)
        sums = [(a + c, b + n) for (a, b), (c, n) in zip(sums, counts)]
    return sums


def _rates(counts: list[tuple[int, int]]) -> list[float]:
    return [round(correct / max(1, scored), 3) for correct, scored in counts]


def checkpoint(head: HeadWeights, config: dict, draft_ids: torch.Tensor,
               options: TrainOptions) -> dict:
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm,
               "lm_head.weight": head.lm_head}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"midlayer.self_attn.{name}.weight"] = getattr(head, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"midlayer.mlp.{name}.weight"] = getattr(head, name).weight
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = getattr(head, name)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}
    tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    head_config = {key: config[key] for key in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "vocab_size", "rms_norm_eps", "max_position_embeddings") if key in config}
    head_config.update(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
        head_dim=head.head_dim, draft_vocab_size=len(draft_ids), hidden_act="silu",
        rope_theta=_rope_theta(config),
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layers(
            config["num_hidden_layers"]))}, flotilla_training=asdict(options))
    return {"tensors": tensors, "config": head_config}


def _rope_theta(config: dict) -> float:
    return float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get(
        "rope_theta", 10000.0))


def write_head(head: dict, directory: Path) -> None:
    save_file(head["tensors"], str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(head["config"], indent=2))


def ensure_head(options: TrainOptions = TrainOptions(), cache_dir: str = "~/.cache/flotilla",
                log=print) -> Path:
    """The default model's EAGLE-3 head for these options, trained on first use (cached)."""
    from benchmarks.eagle_data import make_conversations
    from shared.models import _COMPLETE_MARKER, _build_once, resolve_model

    model = resolve_model("smollm2", cache_dir)
    num_layers = model.config["num_hidden_layers"]
    made_on = [] if options.device == "cpu" else [options.device]  # (cpu: the keys before)
    data_key = hashlib.sha256(json.dumps([str(model.path), options.prompts, options.max_prompt_tokens,
                                          options.max_new_tokens, options.seed,
                                          DATA_VERSION, *made_on]).encode()).hexdigest()[:12]
    key = hashlib.sha256(f"{data_key}|{TRAIN_VERSION}|{json.dumps(asdict(options))}".encode()
                         ).hexdigest()[:12]
    root = Path(cache_dir).expanduser() / "models"
    target = root / f"eagle3-{model.name}-{key}"

    def build(staging: Path) -> None:
        data_path = root / f"eagle-data-{data_key}.pt"
        if data_path.is_file():
            conversations = torch.load(data_path, weights_only=False)
        else:
            conversations = make_conversations(
                model.path, options.prompts, options.max_prompt_tokens, options.max_new_tokens,
                aux_layers(num_layers), options.seed, log=log, device=options.device)
            torch.save(conversations, data_path)
        started = time.perf_counter()
        write_head(train_head(model.path, conversations, options, log), staging)
        log(f"eagle train: {time.perf_counter() - started:.0f} s of training")
        (staging / _COMPLETE_MARKER).write_text("trained EAGLE-3 head\n")

    _build_once(target, _COMPLETE_MARKER, build)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = TrainOptions()
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--cache-dir", default="~/.cache/flotilla")
    args = vars(parser.parse_args())
    cache_dir = args.pop("cache_dir")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(ensure_head(TrainOptions(**args), cache_dir))


if __name__ == "__main__":
    main()
