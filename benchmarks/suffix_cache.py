"""What suffix drafts' response cache (services/scheduler/suffix.py) costs the scheduler:
time to add a finished response, time per lookup, and memory per cached token.

    python -m benchmarks.suffix_cache [--responses 1000] [--tokens 300]

``--responses`` random responses of ``--tokens`` ids go into a cache that keeps
``--keep`` of them (evictions and index rebuilds included); then ``--lookups`` lookups of
half-responses; then, under tracemalloc, a cache filled with ``--keep`` responses.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from services.scheduler.suffix import ResponseCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--keep", type=int, default=100)
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument("--depth", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    data = [[rng.randrange(50_000) for _ in range(args.tokens)] for _ in range(args.responses)]
    cache = ResponseCache(2, args.depth, args.keep)
    started = time.perf_counter()
    for tokens in data:
        cache.add(tokens)
    add_ms = (time.perf_counter() - started) * 1e3 / len(data)
    queries = [data[-1 - i % args.keep][:args.tokens // 2] for i in range(args.lookups)]
    started = time.perf_counter()
    for query in queries:
        cache.continuation(query)
    lookup_us = (time.perf_counter() - started) * 1e6 / len(queries)
    tracemalloc.start()
    filled = ResponseCache(2, args.depth, args.keep)
    for tokens in data[:args.keep]:
        filled.add(tokens)
    memory, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"add {add_ms:.3f} ms per response of {args.tokens} tokens; lookup {lookup_us:.1f} us; "
          f"{memory / (args.keep * args.tokens):.0f} bytes per cached token "
          f"({memory / 2**20:.1f} MiB for {args.keep} responses)")


if __name__ == "__main__":
    main()
