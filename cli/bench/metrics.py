"""Benchmark figures from per-request timings. Pure arithmetic: no I/O, no clocks.

Definitions (times in seconds here; the report shows milliseconds):
- TTFT: send to the first chunk that carries text. A stream whose chunks carry no text at
  all but whose usage counts output tokens (a random-weight model's token ids can decode to
  nothing) is timed by its chunks that carry a choice instead (see ``RequestRecord.text``).
- ITL: the gaps between consecutive timed chunks (text-bearing ones, as above). When the
  server says how many tokens each chunk carried, a gap is split evenly over them.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request; undefined for one token.
- E2E: send to the end of the stream.
- Chunk gaps: the gaps between consecutive timed chunks as they arrived (not split over
  their tokens): what a reader of the stream waits. A request's longest one is its stall.
- Tokens per chunk: known when the server said (per-chunk usage).
- Goodput: completed requests that meet every SLO, per second of the run. The ``itl`` SLO
  bounds a request's longest chunk gap: no wait between two chunks longer than it.
"""

from __future__ import annotations

import datetime
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    prompt_len: int  # prompt tokens the dataset meant to send
    output_len: int  # output tokens asked for (max_tokens)
    start_s: float = 0.0  # when it was sent, seconds after the run began
    # the timed chunks, seconds after send: those that carried text, or, when none did
    # (text is False), those that carried a choice
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] | None = None  # tokens per timed chunk, when the server said
    e2e_s: float = 0.0
    num_prompt_tokens: int | None = None  # the server's usage figure, when it sent one
    num_output_tokens: int | None = None  # the server's usage figure, when it sent one
    error: str | None = None
    text: bool = True  # False: the stream's chunks carried no text (tokens counted by usage)
    num_cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    output_text: str | None = None  # the generated text, kept only when asked (multi-turn)
    conversation_id: str | None = None  # multi-turn: the conversation and turn (from 0)
    turn: int | None = None

    @property
    def success(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Stats:
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float
    count: int

    def scaled(self, factor: float) -> Stats:
        return Stats(self.mean * factor, self.median * factor, self.p90 * factor,
                     self.p99 * factor, self.min * factor, self.max * factor, self.count)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks,
    as numpy's default does."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def stats(values: list[float]) -> Stats:
    if not values:
        return Stats(math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, 0)
    return Stats(mean=sum(values) / len(values), median=percentile(values, 50),
                 p90=percentile(values, 90), p99=percentile(values, 99),
                 min=min(values), max=max(values), count=len(values))


def inter_token_latencies(chunk_times_s: list[float],
                          chunk_num_tokens: list[int] | None = None) -> list[float]:
    """Gaps between consecutive chunks. With per-chunk token counts, a chunk of n tokens
    contributes n gaps of gap/n (its tokens arrived together); the first chunk's tokens
    are all in the TTFT."""
    latencies: list[float] = []
    for i in range(1, len(chunk_times_s)):
        gap = chunk_times_s[i] - chunk_times_s[i - 1]
        num_tokens = chunk_num_tokens[i] if chunk_num_tokens else 1
        if num_tokens > 0:
            latencies += [gap / num_tokens] * num_tokens
    return latencies


def chunk_gaps_s(record: RequestRecord) -> list[float]:
    """The gaps between the request's consecutive timed chunks, as they arrived."""
    times = record.chunk_times_s
    return [later - earlier for earlier, later in zip(times, times[1:])]


def longest_chunk_gap_s(record: RequestRecord) -> float:
    """The request's longest wait between two chunks (0 with fewer than two)."""
    return max(chunk_gaps_s(record), default=0.0)


def num_output_tokens(record: RequestRecord) -> int:
    """The server's usage count whenever it gave one; otherwise one token per text chunk
    (a lower bound: a chunk can carry several tokens)."""
    if record.num_output_tokens is not None:
        return record.num_output_tokens
    if record.chunk_num_tokens:
        return sum(record.chunk_num_tokens)
    return len(record.chunk_times_s)


def num_prompt_tokens(record: RequestRecord) -> int:
    return record.num_prompt_tokens if record.num_prompt_tokens is not None else record.prompt_len


def ttft_s(record: RequestRecord) -> float:
    return record.chunk_times_s[0]


def tpot_s(record: RequestRecord) -> float | None:
    num_tokens = num_output_tokens(record)
    if num_tokens < 2:
        return None
    return (record.e2e_s - ttft_s(record)) / (num_tokens - 1)


def meets_slo(record: RequestRecord, slo_s: dict[str, float]) -> bool:
    """True when the request is within every SLO given. A one-token request has no TPOT
    and meets any TPOT SLO; ``itl`` bounds its longest chunk gap."""
    figures = {"ttft": ttft_s(record), "tpot": tpot_s(record) or 0.0,
               "itl": longest_chunk_gap_s(record), "e2e": record.e2e_s}
    return all(figures[name] <= limit for name, limit in slo_s.items())


def summarize(records: list[RequestRecord], duration_s: float,
              slo_s: dict[str, float] | None = None, *, num_in_flight: int = 0,
              num_not_sent: int = 0, deadline_reached: bool = False,
              started_unix: float = 0.0) -> dict:
    """Every figure of one run. ``records`` are the finished requests (completed or
    failed). A run cut short at its deadline (``deadline_reached``) also had
    ``num_in_flight`` requests sent but unfinished and ``num_not_sent`` never sent: both
    are outstanding, neither failed. Token totals count completed requests only."""
    done = [r for r in records if r.success]
    input_tokens = sum(num_prompt_tokens(r) for r in done)
    output_tokens = sum(num_output_tokens(r) for r in done)
    tpots = [t for t in (tpot_s(r) for r in done) if t is not None]
    itls = [gap for r in done for gap in inter_token_latencies(r.chunk_times_s, r.chunk_num_tokens)]
    num_outstanding = num_in_flight + num_not_sent
    summary = {
        "num_requests": len(records) + num_outstanding, "completed": len(done),
        "failed": len(records) - len(done), "outstanding": num_outstanding,
        "outstanding_in_flight": num_in_flight, "outstanding_not_sent": num_not_sent,
        "deadline_reached": deadline_reached,
        "completed_without_text": sum(not r.text for r in done),
        "failure_reasons": dict(Counter(r.error for r in records if not r.success)),
        "duration_s": duration_s, "started_unix": started_unix,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": _rate(len(done), duration_s),
        "input_throughput": _rate(input_tokens, duration_s),
        "output_throughput": _rate(output_tokens, duration_s),
        "total_token_throughput": _rate(input_tokens + output_tokens, duration_s),
        "ttft_ms": asdict(stats([ttft_s(r) for r in done]).scaled(1000)),
        "tpot_ms": asdict(stats(tpots).scaled(1000)),
        "itl_ms": asdict(stats(itls).scaled(1000)),
        "e2e_ms": asdict(stats([r.e2e_s for r in done]).scaled(1000)),
        **chunk_figures(done),
        **prefix_cache_figures(done),
    }
    if slo_s:
        num_good = sum(meets_slo(r, slo_s) for r in done)
        summary.update(slo_ms={k: v * 1000 for k, v in slo_s.items()}, good_requests=num_good,
                       goodput=_rate(num_good, duration_s),
                       slo_misses=slo_misses(done, slo_s, started_unix))
    return summary


def slo_misses(records: list[RequestRecord], slo_s: dict[str, float],
               started_unix: float = 0.0, limit: int = 5) -> list[dict]:
    """The first ``limit`` completed requests outside the SLO, each with its longest gap:
    when it ended (seconds after the run began; also in UTC, to find in a server's logs,
    when ``started_unix``, the run's start on the wall clock, is given) and how many of the
    other requests streaming through it (their first chunk before it, their last after)
    were stalled in it too, for at least half its length (all of them: the server or client
    paused; none: something of this request's own)."""
    misses = []
    for record in [r for r in records if not meets_slo(r, slo_s)][:limit]:
        gaps = chunk_gaps_s(record)
        miss = {"start_s": round(record.start_s, 3), "ttft_ms": round(1e3 * ttft_s(record), 1),
                "longest_gap_ms": round(1e3 * max(gaps, default=0.0), 1),
                "num_output_tokens": num_output_tokens(record)}
        if gaps:
            after_chunk = gaps.index(max(gaps))
            began = record.start_s + record.chunk_times_s[after_chunk]
            ended = record.start_s + record.chunk_times_s[after_chunk + 1]
            streaming = [r for r in records if r is not record and r.chunk_times_s
                         and r.start_s + r.chunk_times_s[0] < began
                         and r.start_s + r.chunk_times_s[-1] > ended]
            stalled = [r for r in streaming
                       if longest_silence_s(r, began, ended) >= (ended - began) / 2]
            miss |= {"gap_after_chunk": after_chunk, "gap_ended_s": round(ended, 3),
                     "others_streaming": len(streaming), "others_stalled": len(stalled)}
            if started_unix:
                miss["gap_ended_utc"] = datetime.datetime.fromtimestamp(
                    started_unix + ended, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        misses.append(miss)
    return misses


def longest_silence_s(record: RequestRecord, began: float, ended: float) -> float:
    """The longest stretch of [began, ended] (run seconds) in which ``record`` got no chunk."""
    inside = [record.start_s + t for t in record.chunk_times_s
              if began < record.start_s + t < ended]
    points = [began, *inside, ended]
    return max(later - earlier for earlier, later in zip(points, points[1:]))


def chunk_figures(records: list[RequestRecord]) -> dict:
    """How the streams arrived: every gap between chunks, each request's longest, and the
    tokens per chunk where the server said (count 0 otherwise)."""
    return {
        "chunk_gap_ms": asdict(stats([gap for r in records for gap in chunk_gaps_s(r)])
                               .scaled(1000)),
        "longest_chunk_gap_ms": asdict(stats([longest_chunk_gap_s(r) for r in records
                                              if len(r.chunk_times_s) > 1]).scaled(1000)),
        "tokens_per_chunk": asdict(stats([float(n) for r in records
                                          for n in (r.chunk_num_tokens or [])])),
    }


def prefix_cache_figures(records: list[RequestRecord]) -> dict:
    """Prompt tokens the server's prefix cache served, by its own usage figures
    (``cached_tokens``), over the prompt tokens of the requests that reported them. The
    rate is NaN when no request reported cached tokens (a server that does not say)."""
    reported = [r for r in records if r.num_cached_tokens is not None]
    num_cached = sum(r.num_cached_tokens for r in reported)
    num_prompt = sum(num_prompt_tokens(r) for r in reported)
    return {"total_cached_tokens": num_cached,
            "prefix_cache_hit_rate": num_cached / num_prompt if num_prompt else math.nan}


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else math.nan


def latency_samples_ms(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Each latency figure's samples over the completed requests, in milliseconds."""
    done = [r for r in records if r.success]
    return {
        "TTFT": [ttft_s(r) * 1000 for r in done],
        "TPOT": [t * 1000 for t in (tpot_s(r) for r in done) if t is not None],
        "ITL": [gap * 1000 for r in done
                for gap in inter_token_latencies(r.chunk_times_s, r.chunk_num_tokens)],
        "E2E": [r.e2e_s * 1000 for r in done],
    }


TURN_FIGURES = ("completed", "failed", "total_input_tokens", "total_cached_tokens",
                "prefix_cache_hit_rate", "ttft_ms", "e2e_ms")


def turn_summaries(records: list[RequestRecord], duration_s: float) -> list[dict]:
    """A multi-turn run's figures per turn (records with a ``turn``), turn 0 first. Rates
    over the run's whole duration would mislead for a part of it, so only counts,
    latencies and the prefix-cache hit rate."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    summaries = []
    for turn in turns:
        summary = summarize([r for r in records if r.turn == turn], duration_s)
        summaries.append({"turn": turn, **{key: summary[key] for key in TURN_FIGURES}})
    return summaries
