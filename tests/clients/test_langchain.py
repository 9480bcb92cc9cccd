"""langchain-openai's ChatOpenAI against the stack: invoke, stream, tool binding and
structured output over chat completions, and invoke/stream over /v1/responses."""

from __future__ import annotations

import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.clients.conftest import QUESTION

pytestmark = pytest.mark.integration


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny in {city}"


class Capital(BaseModel):
    country: str
    capital: str


def chat_model(base_url: str, model_name: str, **options) -> ChatOpenAI:
    return ChatOpenAI(model=model_name, base_url=base_url, api_key="unused", temperature=0,
                      max_tokens=32, max_retries=0, **options)


@pytest.fixture(scope="module")
def llm(base_url, model_name):
    return chat_model(base_url, model_name)


def test_invoke_and_stream_agree(llm):
    message = llm.invoke(QUESTION)
    assert "Paris" in message.content
    assert message.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == message.content


def test_bind_tools_with_a_forced_tool(llm):
    # strict: the arguments schema closes the object (additionalProperties false), so the
    # constrained output ends once "city" is written
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    message = bound.invoke("What is the weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    assert message.tool_calls[0]["id"]


def test_with_structured_output(llm):
    answer = llm.with_structured_output(Capital).invoke(QUESTION)  # json_schema, strict
    assert isinstance(answer, Capital)
    assert answer.capital == "Paris"


def test_responses_api(base_url, model_name):
    llm = chat_model(base_url, model_name, use_responses_api=True)
    message = llm.invoke(QUESTION)
    assert "Paris" in message.text
    assert message.response_metadata["status"] == "completed"
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == message.text
