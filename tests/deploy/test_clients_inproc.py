"""Agent client libraries nobody here wrote, against the in-process app (issue 37, Must show 1 and 4):
the OpenAI Agents SDK with its default Responses model, pydantic-ai, langchain-openai, litellm and
the anthropic SDK, each running one tool call and one structured output. The weights are random, so
what passes is the protocol, the grammar and the parser: every call's arguments and every structured
answer validate (through each library's own parsing: pydantic models, its tool plumbing).
"""

import asyncio
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from inproc import preset, serve

KEY = "clients-key"
USER = "What is the weather in Paris?"
City = Literal["Paris", "Berlin", "Tokyo"]  # a tool's string argument, closed: a library's schema bounds no
# string, and a random model's string can run to max_tokens (then there is no call to check)


class Weather(BaseModel):
    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = Weather.model_json_schema()


class Sky(BaseModel):
    """The structured answers: enums and a bool, since a client may strip keywords its provider's strict
    mode lacks (pydantic-ai drops maxLength for OpenAI) and then a random string could be any length."""

    unit: Literal["celsius", "fahrenheit"]
    sky: Literal["sunny", "rain", "snow"]
    windy: bool


@pytest.fixture(scope="module")
def k2():
    with serve(preset("kimi-k2-tiny", seed=6), served_model_name="k2", attention=1, experts=1, api_key=KEY,
               max_num_seqs=16, max_tokens_per_step=512, num_blocks=1024) as server:
        yield server


def _async_openai(server):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def test_openai_agents_sdk_default_responses_model_calls_a_tool_and_returns_structured_output(k2):
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)  # no trace export (it would go to OpenAI)
    calls = []

    @function_tool
    def get_weather(city: City, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        calls.append((city, unit))  # the SDK validated the arguments against its own schema first
        return "sunny"

    async def run():
        model = OpenAIResponsesModel(model="k2", openai_client=_async_openai(k2))
        tool_agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                           model_settings=ModelSettings(tool_choice="required", max_tokens=300,
                                                        parallel_tool_calls=False),
                           tool_use_behavior="stop_on_first_tool")
        called = await Runner.run(tool_agent, USER, max_turns=2)
        typed = Agent(name="typed", instructions="Answer as JSON.", output_type=Sky, model=model,
                      model_settings=ModelSettings(max_tokens=300))
        return called, await Runner.run(typed, USER, max_turns=1)

    called, typed = asyncio.run(run())
    assert calls and called.final_output == "sunny" and calls[0][1] in ("celsius", "fahrenheit")
    assert isinstance(typed.final_output, Sky)


def test_pydantic_ai_calls_a_tool_and_returns_structured_output(k2):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("k2", provider=OpenAIProvider(openai_client=_async_openai(k2)))
    calls = []
    agent = Agent(model, output_type=Sky, model_settings={"max_tokens": 300, "seed": 1})  # the output as a tool call

    @agent.tool_plain
    def get_weather(city: City) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    async def run():
        as_tool = await agent.run(USER)
        native = await Agent(model, output_type=NativeOutput(Sky), model_settings={"max_tokens": 300, "seed": 2}).run(USER)
        return as_tool, native

    as_tool, native = asyncio.run(run())
    assert isinstance(as_tool.output, Sky) and isinstance(native.output, Sky)
    tool_calls = [p for m in as_tool.all_messages() for p in getattr(m, "parts", ()) if p.part_kind == "tool-call"]
    assert tool_calls and all(p.tool_name in ("get_weather", "final_result") for p in tool_calls)


def test_langchain_openai_binds_a_tool_and_returns_structured_output(k2):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: City, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model="k2", base_url=f"{k2.url}/v1", api_key=KEY, max_tokens=300, max_retries=0, timeout=300,
                     seed=3)
    msg = llm.bind_tools([get_weather], tool_choice="required").invoke(USER)
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], get_weather.tool_call_schema.model_json_schema())
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}
    typed = llm.with_structured_output(Sky, method="json_schema").invoke(USER)
    assert isinstance(typed, Sky)


def test_litellm_calls_a_tool_and_returns_structured_output(k2, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    common = dict(model="openai/k2", api_base=f"{k2.url}/v1", api_key=KEY, max_tokens=300, num_retries=0, seed=4,
                  messages=[{"role": "user", "content": USER}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    r = litellm.completion(**common, tools=tools, tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    s = litellm.completion(**common, response_format=Sky)
    Sky.model_validate_json(s.choices[0].message.content)


def test_anthropic_sdk_calls_a_tool_and_parses_structured_output(k2):
    import anthropic

    client = anthropic.Anthropic(base_url=k2.url, api_key=KEY, max_retries=0, timeout=300)
    m = client.messages.create(model="k2", max_tokens=300, messages=[{"role": "user", "content": USER}],
                               tools=[{"name": "get_weather", "input_schema": WEATHER}],
                               tool_choice={"type": "tool", "name": "get_weather"})
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    parsed = client.messages.parse(model="k2", max_tokens=300, messages=[{"role": "user", "content": USER}],
                                   output_format=Sky)
    assert isinstance(parsed.parsed_output, Sky)
