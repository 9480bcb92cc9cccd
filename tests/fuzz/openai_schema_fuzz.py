"""Fuzz a running flotilla with OpenAI's own OpenAPI description of chat completions,
completions and models (tests/fuzz/openai_openapi_subset.json), and count the answers.
Not part of the test run (it takes minutes); docs/openai-api.md has its last result.

    .venv/bin/python -m tests.fuzz.openai_schema_fuzz --cases 1000   # starts its own stack
    .venv/bin/python -m tests.fuzz.openai_schema_fuzz --base-url http://127.0.0.1:8000

Every request is sent with the served model's name and its generation bounded
(tests/fuzz/clamp.py). A failure is a 5xx, a connection error, or an answer slower than
--deadline-s; the exit status is 1 if there was any.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from tests.fuzz.clamp import clamp_body

SCHEMA = Path(__file__).with_name("openai_openapi_subset.json")
SHARES = {"POST /chat/completions": 0.45, "POST /completions": 0.45, "GET /models": 0.02,
          "GET /models/{model}": 0.08}


def fuzz(base_url: str, num_cases: int, deadline_s: float, seed: int) -> dict:
    model_name = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(json.loads(SCHEMA.read_text()))
    counts: dict[str, collections.Counter] = {}
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        statuses = counts.setdefault(label, collections.Counter())
        target = max(1, round(num_cases * SHARES.get(label, 0.0)))

        @settings(max_examples=target, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(case=operation.as_strategy())
        def run(case):
            if sum(statuses.values()) >= target:
                return
            case.body = clamp_body("/v1" + operation.path, case.body, model_name)
            sent = time.monotonic()
            try:
                response = case.call(base_url=f"{base_url}/v1", timeout=deadline_s + 30)
            except Exception as exc:  # noqa: BLE001 - a hang or a dropped connection counts
                statuses["error"] += 1
                failures.append(f"{label}: {type(exc).__name__}: {exc} {case.body!r:.300}")
                return
            elapsed = time.monotonic() - sent
            statuses[response.status_code] += 1
            if response.status_code >= 500 or elapsed > deadline_s:
                failures.append(f"{label}: {response.status_code} in {elapsed:.1f} s: "
                                f"{response.text[:300]} <- {case.body!r:.300}")

        for _ in range(20):  # hypothesis stops early on small spaces: draw again
            if sum(statuses.values()) >= target:
                break
            run()
    return {"model": model_name, "schema": json.loads(SCHEMA.read_text())["info"]["x-source"],
            "cases": sum(sum(c.values()) for c in counts.values()),
            "by_operation": {label: dict(sorted(c.items(), key=str)) for label, c in counts.items()},
            "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running flotilla (default: start one)")
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--deadline-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stack = None
    base_url = args.base_url
    if base_url is None:
        from cli.stack import Stack, StackOptions, free_port

        stack = Stack(StackOptions(model="smollm2", host="127.0.0.1", port=free_port(),
                                   log_dir=Path(tempfile.mkdtemp(prefix="flotilla-fuzz-"))))
        stack.start(timeout_s=300)
        base_url = stack.base_url
    try:
        started = time.monotonic()
        report = fuzz(base_url.rstrip("/"), args.cases, args.deadline_s, args.seed)
        report["seconds"] = round(time.monotonic() - started, 1)
    finally:
        if stack is not None:
            stack.stop()
    print(json.dumps(report, indent=2))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
