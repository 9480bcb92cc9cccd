import pytest

from shared.models import resolve_model


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's Hugging Face tokenizer (what the gateway decodes with)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2").path))
