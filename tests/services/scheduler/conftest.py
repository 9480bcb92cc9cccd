"""Fixtures shared by the scheduler's tests against a real nats-server."""

from __future__ import annotations

import pytest

from services.scheduler import kv_client
from tests.nats_server import started_nats_server


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    """A real nats-server for the module, on a free port."""
    server = started_nats_server(tmp_path_factory.mktemp("nats") / "nats.log")
    yield server.url
    server.stop()


@pytest.fixture
def unhurried_kvstore_calls(monkeypatch):
    """The product's deadlines for a lookup (50 ms) and a pin (200 ms of host hits, 1 s with
    disk reads) are shorter than a loaded two-core machine may take to answer in one test
    process: a test of what a hit does would see a miss. A test of a deadline sets its own
    (its monkeypatch comes after this one)."""
    monkeypatch.setattr(kv_client, "LOOKUP_TIMEOUT_S", 10.0)
    monkeypatch.setattr(kv_client, "HOST_PIN_TIMEOUT_S", 10.0)
    monkeypatch.setattr(kv_client, "PIN_TIMEOUT_S", 10.0)
