"""Load or recompute: whether a kvstore hit is worth loading (docs/kvstore.md), pure.

Three speeds are measured as running means: the host tier's load speed (host slots ->
KV blocks, reported by the worker with each step that loaded), the disk tier's read
speed (disk -> host slots, reported by the kvstore with each lookup) and the prefill
speed (prompt tokens per second of the steps that mostly computed prompts). A block hit
saves ``block_size / prefill`` seconds of compute and costs ``block_bytes / host`` to load
(a disk hit also ``block_bytes / disk`` to read in first). The leading run of hit blocks
that saves the most is used, if it saves anything at all: a hit is never used when
recomputing it is measured faster.

Also measured here for routing (docs/routing.md): what one more decoding sequence adds to a
decode step, as the slope of step time over batch size (running moments of decode-only
steps), reported in prompt tokens' compute.

Until a speed is measured, it is assumed to favour loading (the hit is used, and using it
measures it): an unknown prefill speed makes every hit worth it, an unknown load or read
speed costs nothing. So the first hits are loaded, and the policy learns from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

EWMA_WEIGHT = 0.3  # of the newest sample in each running mean
# Decode cost: running moments of (sequences, step time) over decode-only steps; the slope
# is read once batch sizes have varied by about a sequence (a fixed size shows no slope).
DECODE_MOMENT_WEIGHT = 0.05
MIN_DECODE_SIZE_VARIANCE = 0.25
# A step counts as a prefill sample when it computed at least this many prompt tokens
# and they were most of its tokens (decodes cost more per token and would bias it).
MIN_PREFILL_SAMPLE_TOKENS = 32
MIN_PREFILL_SHARE = 0.8
HOST, DISK = "host", "disk"


def _ewma(mean: float | None, sample: float) -> float:
    return sample if mean is None else (1 - EWMA_WEIGHT) * mean + EWMA_WEIGHT * sample


@dataclass
class TierSpeeds:
    """Measured speeds; None until the first sample."""

    host_load_bytes_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    # running means over decode-only steps: sequences, seconds, sequences², sequences x seconds
    decode_moments: tuple[float, float, float, float] | None = None

    def observe_load(self, bytes_per_s: float) -> None:
        if bytes_per_s > 0:
            self.host_load_bytes_per_s = _ewma(self.host_load_bytes_per_s, bytes_per_s)

    def observe_disk_read(self, bytes_per_s: float) -> None:
        if bytes_per_s > 0:  # 0: the kvstore has not measured it yet
            self.disk_read_bytes_per_s = _ewma(self.disk_read_bytes_per_s, bytes_per_s)

    def observe_step(self, num_tokens: int, num_prompt_tokens: int, step_time_s: float,
                     load_bytes: int = 0, load_bytes_per_s: float = 0.0) -> None:
        """One step's result: its prompt tokens feed the prefill speed (the time the step
        spent loading blocks is taken out), its loads the host load speed."""
        load_time_s = 0.0
        if load_bytes > 0 and load_bytes_per_s > 0:
            self.observe_load(load_bytes_per_s)
            load_time_s = load_bytes / load_bytes_per_s
        compute_s = step_time_s - load_time_s
        if (num_prompt_tokens >= MIN_PREFILL_SAMPLE_TOKENS and compute_s > 0
                and num_prompt_tokens >= MIN_PREFILL_SHARE * num_tokens):
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, num_tokens / compute_s)
        if num_prompt_tokens == 0 and num_tokens > 0 and load_bytes == 0 and step_time_s > 0:
            self._observe_decode(num_tokens, step_time_s)

    def _observe_decode(self, num_seqs: int, step_time_s: float) -> None:
        sample = (num_seqs, step_time_s, num_seqs * num_seqs, num_seqs * step_time_s)
        if self.decode_moments is None:
            self.decode_moments = tuple(float(x) for x in sample)
            return
        w = DECODE_MOMENT_WEIGHT
        self.decode_moments = tuple((1 - w) * mean + w * x
                                    for mean, x in zip(self.decode_moments, sample))

    @property
    def decode_seq_s(self) -> float | None:
        """Seconds one more sequence adds to a decode step (the least-squares slope of
        step time over batch size); None until batch sizes have varied, or if the slope
        is not positive (noise)."""
        if self.decode_moments is None:
            return None
        mean_n, mean_t, mean_nn, mean_nt = self.decode_moments
        variance = mean_nn - mean_n * mean_n
        if variance < MIN_DECODE_SIZE_VARIANCE:
            return None
        slope = (mean_nt - mean_n * mean_t) / variance
        return slope if slope > 0 else None

    @property
    def decode_seq_cost_tokens(self) -> float | None:
        """``decode_seq_s`` in prompt tokens' compute (routing prices load with it)."""
        if self.decode_seq_s is None or not self.prefill_tokens_per_s:
            return None
        return self.decode_seq_s * self.prefill_tokens_per_s

    # ------------------------------------------------------------ the decision
    def block_saving_s(self, tier: str, block_bytes: int, block_size: int) -> float:
        """Seconds saved by loading one block of ``tier`` instead of recomputing it
        (negative: recomputing is faster)."""
        if self.prefill_tokens_per_s is None:
            return float("inf")
        cost_s = _seconds(block_bytes, self.host_load_bytes_per_s)
        if tier == DISK:
            cost_s += _seconds(block_bytes, self.disk_read_bytes_per_s)
        return block_size / self.prefill_tokens_per_s - cost_s

    def num_blocks_worth_loading(self, tiers: Sequence[str], block_bytes: int,
                                 block_size: int) -> int:
        """How many of the leading hit blocks (one tier each, in order) to load: the
        run that saves the most time, 0 when none saves any."""
        if self.prefill_tokens_per_s is None:
            return len(tiers)  # not measured: load, and learn
        best_count, best_saving, saving = 0, 0.0, 0.0
        saving_by_tier = {tier: self.block_saving_s(tier, block_bytes, block_size)
                          for tier in set(tiers)}  # (once per tier, not per block)
        for count, tier in enumerate(tiers, start=1):
            saving += saving_by_tier[tier]
            if saving > best_saving:
                best_count, best_saving = count, saving
        return best_count


def _seconds(num_bytes: int, bytes_per_s: float | None) -> float:
    return num_bytes / bytes_per_s if bytes_per_s else 0.0
