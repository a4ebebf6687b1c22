"""Agent frameworks' tool loops against the served model, as their users write them: a
LangChain agent (langchain-openai's ChatOpenAI, and langchain-anthropic's ChatAnthropic
over the Messages API, with bind_tools), the OpenAI Agents SDK (over the Responses API)
and LiteLLM's tool-call path (litellm.completion with an openai/ model and api_base), each
in two steps: a call to one of two tools, then the tool's result sent back and a final
answer.

The gateway is real uvicorn on loopback (BackgroundServer, what `skippy serve` runs) over
a random-weight qwen3 whose chat template knows tools (conftest: qwen3_tools), in 2
stages. Random weights never call a tool by themselves, so step 1 forces a call
(tool_choice "required") and step 2 answers with "none". Run inside a loopback-only
network namespace."""

from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tool_schemas import ADD, WEATHER


MODEL = "qwen3-tools"
QUESTION = "How warm is it in Oslo, in celsius?"


@pytest.fixture(scope="module")
def url(qwen3_tools_url):
    return qwen3_tools_url


# -- LangChain -------------------------------------------------------------------------------------
class WeatherArgs(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    unit: Literal["celsius", "fahrenheit"]


class AddArgs(BaseModel):
    a: int = Field(ge=0, le=999)
    b: int = Field(ge=0, le=999)


@pytest.fixture(scope="module")
def lc_tools():
    from langchain_core.tools import StructuredTool
    weather = StructuredTool.from_function(
        lambda city, unit: f"-3 degrees {unit} in {city}", name="get_weather",
        description="The weather in a city now.", args_schema=WeatherArgs)
    add = StructuredTool.from_function(lambda a, b: str(a + b), name="add",
                                       description="The sum of two numbers.",
                                       args_schema=AddArgs)
    return {"get_weather": weather, "add": add}


@pytest.fixture(scope="module")
def chat_model(url):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="x", temperature=0,
                      max_tokens=96, max_retries=0)


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
def test_langchain_agent_calls_a_tool_and_answers(chat_model, lc_tools, streamed):
    from langchain_core.messages import HumanMessage
    tools = list(lc_tools.values())
    caller = chat_model.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    history = [HumanMessage(QUESTION)]
    if streamed:
        parts = list(caller.stream(history))
        ai = parts[0]
        for part in parts[1:]:
            ai += part
    else:
        ai = caller.invoke(history)
    assert not ai.invalid_tool_calls
    [call] = ai.tool_calls
    tool = lc_tools[call["name"]]
    tool.args_schema.model_validate(call["args"])  # the arguments fit the tool's schema
    assert call["id"].startswith("call_")
    assert ai.response_metadata.get("finish_reason") == "tool_calls"
    result = tool.invoke(call)  # a ToolMessage answering the call by its id
    assert result.tool_call_id == call["id"]
    answer = chat_model.bind_tools(tools, tool_choice="none").invoke(
        [*history, ai, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


@pytest.mark.parametrize("streamed", [False, True], ids=["invoke", "stream"])
def test_langchain_chat_anthropic_calls_a_tool_and_answers(url, lc_tools, streamed):
    """The same loop through LangChain's ChatAnthropic: Anthropic's Messages API."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage
    model = ChatAnthropic(model=MODEL, base_url=url, api_key="x", max_tokens=96,
                          max_retries=0, temperature=0, streaming=streamed)
    tools = list(lc_tools.values())
    history = [HumanMessage(QUESTION)]
    ai = model.bind_tools(tools, tool_choice="any", parallel_tool_calls=False).invoke(history)
    assert not ai.invalid_tool_calls
    [call] = ai.tool_calls
    tool = lc_tools[call["name"]]
    tool.args_schema.model_validate(call["args"])
    assert ai.response_metadata.get("stop_reason") == "tool_use"
    result = tool.invoke(call)
    answer = model.invoke([*history, ai, result])  # no tools offered: text
    assert answer.text and not answer.tool_calls


# -- the OpenAI Agents SDK ---------------------------------------------------------------------
class Answer(BaseModel):
    celsius: Literal[-3, 0, 20]


def test_an_agents_sdk_agent_runs_its_tool_loop(url):
    """A one-tool agent over the Responses API (streamed, as the SDK asks): turn 1 must
    call the tool, the SDK then resets tool_choice and turn 2 gives the agent's typed
    output (its JSON schema constrains the reply); bounded by max_turns."""
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI
    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    cities = []

    @function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city now."""
        cities.append(city)
        return f"-3 degrees celsius in {city}"

    client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  output_type=Answer,
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=48))
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=4))
    assert len(cities) == 1 and isinstance(result.final_output, Answer)
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]


# -- LiteLLM ---------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]


@pytest.fixture(scope="module")
def litellm():
    # LiteLLM fetches a model cost map from the internet on import unless told not to
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm
    litellm.telemetry = False
    return litellm


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
def test_litellm_tool_loop(litellm, url, streamed):
    common = {"model": f"openai/{MODEL}", "api_base": url + "/v1", "api_key": "x",
              "temperature": 0, "tools": TOOLS, "num_retries": 0}
    messages = [{"role": "user", "content": QUESTION}]
    first = litellm.completion(messages=messages, tool_choice="required",
                               parallel_tool_calls=False, max_tokens=96, stream=streamed,
                               **common)
    if streamed:
        first = litellm.stream_chunk_builder(list(first), messages=messages)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER if call.function.name == "get_weather" else ADD)
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "-3 C"}]
    final = litellm.completion(messages=messages, tool_choice="none", max_tokens=8, **common)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")
