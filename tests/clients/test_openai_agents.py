"""The openai-agents SDK against the stack: an agent with a function tool, over both its
Responses model and its chat-completions model. The first turn must call the tool
(tool_choice required; the SDK resets it to auto afterwards), the second sends the call
and its output back and gets the final answer."""

from __future__ import annotations

import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

pytestmark = pytest.mark.integration
set_tracing_disabled(True)  # no trace export: nothing outside can be reached


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
async def test_agent_calls_its_tool(base_url, model_name, model_class):
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="You answer questions about the weather.",
                  tools=[get_weather], model=model_class(model=model_name, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=24))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
    assert len(cities) == 1 and cities[0]
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem,
                                                         MessageOutputItem]
    assert isinstance(result.final_output, str) and result.final_output
    await client.close()
