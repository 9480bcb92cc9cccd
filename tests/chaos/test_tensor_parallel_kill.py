"""A tensor-parallel worker (two ranks over gloo) under load: kill -9 of rank 1 ends the whole
group at once (rank 0 exits with EXIT_RANK_LOST, nothing waits on a collective), and once the
worker is started again, as its supervisor would, every stream in flight ends with the text
of its solo run."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from services.worker.tp_group import EXIT_RANK_LOST
from tests.chaos.streams import StreamReader
from tests.chaos.test_kill_restart import PROMPTS, assert_same_as_solo, body, migrations, solo_texts
from tests.integration.conftest import start_stack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


@pytest.fixture(scope="module")
def split_replica(tmp_path_factory):
    stack = start_stack(tmp_path_factory.mktemp("tp-logs"), kvstore=False,
                        service_args={"worker": ["--kv-cache-memory", "128MiB",
                                                 "--tensor-parallel-size", "2"]})
    yield stack
    stack.stop()


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_killing_one_rank_fails_the_group_and_streams_resume(split_replica, model_name):
    stack = split_replica
    reference = solo_texts(stack, model_name)
    before = migrations(stack)
    worker = stack.processes["worker"]
    (rank_1,) = [child for child in psutil.Process(worker.pid).children()
                 if "resource_tracker" not in " ".join(child.cmdline())]  # (spawn's helper)
    readers = [StreamReader(stack.base_url, body(model_name, p)) for p in PROMPTS]
    for reader in readers:
        reader.start()
    assert wait_for(lambda: all(len(r.parts) >= 3 for r in readers), 90), "no text before the kill"
    killed_at = time.monotonic()
    rank_1.send_signal(signal.SIGKILL)
    assert wait_for(lambda: worker.poll() is not None, 10), "rank 0 outlived rank 1"
    assert worker.returncode == EXIT_RANK_LOST
    assert time.monotonic() - killed_at < 10
    stack.start_service("worker")  # what the supervisor (or Kubernetes) does
    for reader in readers:
        reader.join(150)
        assert not reader.is_alive(), "a stream hung"
    assert_same_as_solo(readers, reference)
    assert migrations(stack) >= before + len(PROMPTS)
