import pytest

from services.tokenizer.encoding import TextCodec
from shared.models import resolve_model


@pytest.fixture(scope="session")
def codec() -> TextCodec:
    return TextCodec(resolve_model("smollm2").path)


@pytest.fixture(scope="session")
def tokenizer(codec: TextCodec):
    return codec.tokenizer
