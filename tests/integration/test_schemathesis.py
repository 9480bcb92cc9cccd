"""Fuzz the running stack with schemathesis from its own /openapi.json: every response is
not a 5xx, arrives within a deadline, and matches the schema of its status (bodies, status
codes, content types). Generation is bounded on the client side (tests/fuzz/clamp.py)."""

from __future__ import annotations

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from tests.fuzz.clamp import clamp_body

pytestmark = pytest.mark.integration

DEADLINE_S = 20.0  # one response, on a 2-core machine shared with the whole stack
BUDGET_S = {"POST": 12.0, "GET": 2.0}  # per operation: about 80 s for the whole fuzz
EXAMPLES = {"POST": 40, "GET": 8}  # per operation, unless its budget runs out first
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema(stack):
    return schemathesis.openapi.from_url(stack.base_url + "/openapi.json")


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_fuzz_the_api_from_its_own_schema(stack, api_schema, model_name):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions",
                                              "/tokenize", "/detokenize", "/v1/models"}
    counts: dict[str, dict[int, int]] = {}
    for operation in operations:
        method = operation.method.upper()
        label = f"{method} {operation.path}"
        statuses = counts.setdefault(label, {})
        deadline = time.monotonic() + BUDGET_S.get(method, 2.0)

        @settings(max_examples=EXAMPLES.get(method, 8), deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case):
            if time.monotonic() > deadline:
                return
            case.body = clamp_body(operation.path, case.body, model_name)
            sent = time.monotonic()
            response = case.call(base_url=stack.base_url, timeout=DEADLINE_S + 5)
            elapsed = time.monotonic() - sent
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert elapsed < DEADLINE_S, f"{label} took {elapsed:.1f} s: {case.body!r}"
            case.validate_response(response, checks=CHECKS)

        run()
    print(counts)
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert counts[label].get(200, 0) >= 5, counts[label]  # generation reached, not refused
    assert sum(n for c in counts.values() for n in c.values()) >= 60
