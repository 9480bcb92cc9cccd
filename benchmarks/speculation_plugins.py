"""Speculative decoding's benchmark-only modes, kept out of the product: a benchmark installs
them in process into the engine it runs (cli/engine.py's ``Engine``: the real scheduler and
ModelRunner in one process), after building it and before its first request.

- replay (``method: "replay"``, ``replay_path``): the scheduler's proposer is replaced by one
  that proposes the next tokens of each request's saved output (JSON ``{"prompts": [[ids]],
  "outputs": [[ids]]}``, e.g. the same engine's greedy outputs without speculation), found by
  its prompt. Every draft is then right: it measures what the verify machinery gives at full
  acceptance, whatever the proposer.
- synthetic acceptance (``rejection_sample_method: "synthetic"``,
  ``synthetic_acceptance_length`` L, vLLM's names): the worker's acceptance rule is replaced
  by one that keeps a set number of each step's drafts whatever the model computes,
  ``floor(L - 1)`` always and one more with the fractional rest's probability (seeded: a run
  repeats), so L tokens a verify step on average; the token after them is sampled as after
  kept drafts. Output is then not the model's; engines can be compared at one acceptance on
  random weights, where greedy tokens are near-ties and no draft survives.

Benchmarks take vLLM's JSON, so the same string goes to vLLM's peer run:
``split_speculative_config`` takes these modes' fields out of it, and what is left is the
product's --speculative-config (replay drafts under method ngram's policy: its K, batch
limit and adaptive cap).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import msgspec
import torch

from cli.engine import Engine
from services.scheduler.request import Request
from services.scheduler.speculation import DraftPolicy, Drafts, host_drafts
from services.worker.speculation import Adjust, Verified
from services.worker.staging import HostStaging
from services.worker.step_inputs import LogitsLayout, SequenceChunk
from shared.messages import SamplingParams
from shared.sections.speculative import SpeculativeConfig, parse_speculative_config


class BenchmarkModes(msgspec.Struct, frozen=True, kw_only=True):
    """What a benchmark installs (``install``); the defaults install nothing."""

    replay_path: str = ""  # replay: the saved outputs
    synthetic_acceptance_length: float = 0.0  # synthetic acceptance: L (0: drafts verified)


def split_speculative_config(text: str) -> tuple[SpeculativeConfig | None, BenchmarkModes]:
    """vLLM's ``--speculative-config`` JSON, benchmark modes included -> (the product's
    config, the modes); a ValueError for a bad combination or a replay file that cannot be
    read (named)."""
    if not text.strip():
        return None, BenchmarkModes()
    fields = json.loads(text)
    replay_path = fields.pop("replay_path", "")
    if (fields.get("method") == "replay") != bool(replay_path):
        raise ValueError("replay_path goes with method replay, and it needs one")
    if replay_path:
        load_replay(replay_path)  # a bad file fails the start, named
        fields["method"] = "ngram"  # (its policy; the proposer is replaced)
    method = fields.pop("rejection_sample_method", "standard")
    length = fields.pop("synthetic_acceptance_length", 0.0)
    if method not in ("standard", "synthetic"):
        raise ValueError(f"rejection_sample_method {method!r} is not supported "
                         f"(standard or synthetic)")
    if (method == "synthetic") != bool(length):
        raise ValueError("synthetic_acceptance_length goes with rejection_sample_method "
                         "synthetic, and it needs one")
    config = parse_speculative_config(json.dumps(fields))
    if length and not 1.0 <= length <= config.num_speculative_tokens + 1:
        raise ValueError(f"synthetic_acceptance_length must be between 1 and "
                         f"num_speculative_tokens + 1 ({config.num_speculative_tokens + 1})")
    return config, BenchmarkModes(replay_path=replay_path, synthetic_acceptance_length=length)


def install(engine: Engine, modes: BenchmarkModes) -> Engine:
    """Put ``modes`` into ``engine`` (before its first request) -> the engine."""
    if modes.replay_path:
        drafter = engine.scheduler.drafter
        if not isinstance(drafter, DraftPolicy):
            raise ValueError("replay needs speculative decoding on (method replay)")
        drafter.proposer = ReplayProposer(load_replay(modes.replay_path))
    if modes.synthetic_acceptance_length:
        if engine.runner.ranks.tp.size > 1:  # (the other ranks' runners are other processes)
            raise ValueError("synthetic acceptance runs on a worker of one rank")
        engine.runner.verify = SyntheticAcceptance(modes.synthetic_acceptance_length)
    return engine


class ReplayFile(msgspec.Struct, frozen=True):
    prompts: list[list[int]]
    outputs: list[list[int]]


def load_replay(path: str) -> dict[tuple[int, ...], list[int]]:
    """A replay file's saved outputs by prompt; a ValueError naming the file if it cannot."""
    try:
        saved = msgspec.json.decode(Path(path).read_bytes(), type=ReplayFile)
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"replay_path {path}: {exc}") from None
    if len(saved.prompts) != len(saved.outputs):
        raise ValueError(f"replay_path {path}: {len(saved.prompts)} prompts, "
                         f"{len(saved.outputs)} outputs")
    return {tuple(prompt): output for prompt, output in zip(saved.prompts, saved.outputs)}


class ReplayProposer:
    """A scheduler-side proposer (services/scheduler/speculation.py's ``Proposer``): the next
    tokens of the request's saved output, found by its prompt; none for a prompt not saved."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]) -> None:
        self.outputs = outputs
        # the longest saved prompt a request starts with is its own
        self.prompt_lens = sorted({len(prompt) for prompt in outputs}, reverse=True)
        self._found: dict[str, tuple[int, list[int]]] = {}  # request -> (prompt len, output)

    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> Drafts:
        found = self._found.get(request_id)
        if found is None:
            found = next(((n, self.outputs[tuple(token_ids[:n])]) for n in self.prompt_lens
                          if tuple(token_ids[:n]) in self.outputs), (len(token_ids), []))
            self._found[request_id] = found
        prompt_len, output = found
        start = len(token_ids) - prompt_len  # output tokens so far
        return host_drafts(output[start:start + num_drafts])

    def forget(self, req: Request) -> None:
        self._found.pop(req.request_id, None)


class SyntheticAcceptance:
    """A worker-side acceptance rule (services/worker/speculation.py's ``VerifyRule``): each
    drafted request keeps ``floor(L - 1)`` drafts and one more with the fractional rest's
    probability (never more than it has), unverified; its token is then sampled from the row
    after them."""

    def __init__(self, acceptance_length: float, seed: int = 0) -> None:
        self.kept = acceptance_length - 1.0  # drafts kept a step, on average
        self.draws = random.Random(seed)  # seeded: a benchmark run repeats

    def num_kept(self, num_drafts: int) -> int:
        whole = math.floor(self.kept)
        return min(num_drafts, whole + (self.draws.random() < self.kept - whole))

    def __call__(self, logits: torch.Tensor, layout: LogitsLayout, chunks: list[SequenceChunk],
                 params: list[SamplingParams], output_indices: list[int],
                 adjust: Adjust | None = None, staging: HostStaging | None = None) -> Verified:
        rows = list(layout.sample_rows)
        sampled = [chunk for chunk in chunks if chunk.sample]
        if not any(chunk.num_drafts for chunk in sampled):
            return Verified(rows, [], {})
        accepted = [self.num_kept(chunk.num_drafts) if chunk.num_drafts else 0
                    for chunk in sampled]
        return Verified([row + num for row, num in zip(rows, accepted)], accepted, {})
