"""Training data for an EAGLE head (issue 52): the served model's own greedy replies to
ShareGPT prompts, and its hidden states over them.

Each conversation is the first human turn of a ShareGPT record, in the model's chat template
(the default system prompt included, as ``/v1/chat/completions`` sends it), cut to
``max_prompt_tokens``, and the model's greedy reply of at most ``max_new_tokens``
(flotilla's in-process engine in fp32: on the CPU as served, or on a GPU with ``device``,
which can part from the CPU's reply only at a near tie). One
more forward over prompt + reply gives, per position, the hidden states EAGLE-3 fuses
(``hidden_states[layer]`` of each auxiliary layer: the residual stream entering that layer,
as the worker captures it), the last normed hidden state (EAGLE-1's feature) and the
model's argmax (what a draft at that position must guess to be kept).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from cli.bench.sharegpt import default_path, load_exchanges


@dataclass
class Conversation:
    token_ids: torch.Tensor  # [num_tokens] int64: prompt + reply
    prompt_len: int
    aux_hidden: torch.Tensor  # [num_tokens, len(aux_layers) * hidden] bfloat16
    last_hidden: torch.Tensor  # [num_tokens, hidden] bfloat16: after the final norm
    target_ids: torch.Tensor  # [num_tokens] int64: the model's argmax at each position


def load_target(model_dir: str | Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return tokenizer, model.to(device).eval()


def chat_prompts(tokenizer, num_prompts: int, max_prompt_tokens: int, seed: int
                 ) -> list[list[int]]:
    """``num_prompts`` ShareGPT first turns in the chat template, shuffled with ``seed``."""
    exchanges = load_exchanges(default_path())
    random.Random(seed).shuffle(exchanges)
    prompts = []
    for human, _ in exchanges:
        if len(prompts) == num_prompts:
            break
        if not human.strip():
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": human[:4000]}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
    return prompts


def greedy_replies(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
                   device: str = "cpu") -> list[list[int]]:
    """Each prompt's greedy reply as ``flotilla serve`` gives it (the in-process engine in
    fp32, on ``device``: the served model's own tokens), its end token kept."""
    from cli.engine import Engine
    from services.scheduler.config import SchedulerConfig
    from services.worker.config import WorkerConfig
    from shared.messages import SamplingParams
    from shared.models import ModelFiles

    on_cpu = device == "cpu"
    engine = Engine(SchedulerConfig(max_num_seqs=64 if on_cpu else 256),
                    WorkerConfig(device=device, dtype="float32",
                                 kv_cache_memory="512MiB" if on_cpu else "8GiB"),
                    ModelFiles(name=Path(model_dir).name, path=Path(model_dir)))
    sampling = [SamplingParams(temperature=0.0, max_tokens=max_new_tokens) for _ in prompts]
    completions, _ = engine.generate(prompts, sampling)
    engine.close()
    return [c.output_token_ids for c in completions]


@torch.inference_mode()
def hidden_states(model, token_ids: list[int], prompt_len: int, aux_layers: tuple[int, ...]
                  ) -> Conversation:
    ids = torch.tensor([token_ids])
    out = model(input_ids=ids.to(model.device), output_hidden_states=True)
    layers = out.hidden_states  # num_layers + 1 of [1, num_tokens, hidden]
    aux = torch.cat([layers[i][0] for i in aux_layers], dim=-1)
    return Conversation(ids[0], prompt_len, aux.to(torch.bfloat16).cpu(),
                        layers[-1][0].to(torch.bfloat16).cpu(), out.logits[0].argmax(-1).cpu())


def make_conversations(model_dir: str | Path, num_prompts: int, max_prompt_tokens: int,
                       max_new_tokens: int, aux_layers: tuple[int, ...], seed: int = 0,
                       log=print, device: str = "cpu") -> list[Conversation]:
    tokenizer, model = load_target(model_dir, device)
    prompts = chat_prompts(tokenizer, num_prompts, max_prompt_tokens, seed)
    replies = greedy_replies(model_dir, prompts, max_new_tokens, device)
    log(f"eagle data: {len(replies)} replies, {sum(map(len, replies))} tokens")
    return [hidden_states(model, prompt + reply, len(prompt), aux_layers)
            for prompt, reply in zip(prompts, replies)]
