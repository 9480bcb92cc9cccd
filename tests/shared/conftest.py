import pytest

from shared.models import resolve_model
from tests.nats_server import started_nats_server


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's Hugging Face tokenizer (what the gateway decodes with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2").path))


@pytest.fixture
def nats_url(tmp_path):
    """A real nats-server of the test's own, on a free port."""
    server = started_nats_server(tmp_path / "nats.log")
    yield server.url
    server.stop()
