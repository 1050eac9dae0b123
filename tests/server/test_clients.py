"""The client libraries agent developers use, unchanged, against `specdec serve` over real HTTP (CPU, the default
model): openai-agents, pydantic-ai, langchain-openai, instructor and litellm. For each, a structured output that
must parse into a pydantic model, and a tool loop: the model calls a Python function tool, the library runs it and
sends the result back, and the model answers. Chat Completions for all; the Responses API too where it is the
library's default or it has one (openai-agents, pydantic-ai, langchain `use_responses_api`, `litellm.responses`).

SmolLM2-135M does not call tools by itself, so the first turn forces the call (`tool_choice` "required" or the
named tool) and the next leaves the choice to the model. A library that is not installed skips its tests
(`pip install -e .[clients]`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import jsonschema
import pytest
from pydantic import BaseModel

from serving import CPU_ARGS, api_client, serve

pytestmark = [pytest.mark.clients,
              pytest.mark.filterwarnings("ignore::UserWarning:pydantic")]   # litellm's own TypedDicts

MAX_TOKENS = 64
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1}}, "required": ["city"],
                "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                              "parameters": WEATHER_ARGS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                  "parameters": WEATHER_ARGS}
QUESTION = "What is the weather in Paris?"


class Cat(BaseModel):
    """A cat."""
    name: str
    age: int


class Weather:
    """get_weather as a Python function that records the arguments of every call."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, city: str) -> str:
        self.calls.append({"city": city})
        return f"Sunny, 21 C in {city}"

    def check(self, sent: list[dict]) -> None:
        """The tool ran, once per call the model made, with arguments that validate against its schema."""
        assert self.calls, "the tool was never called"
        assert self.calls == sent
        for args in self.calls:
            jsonschema.validate(args, WEATHER_ARGS)


def final_text(text) -> str:
    assert isinstance(text, str) and text.strip(), f"no final answer: {text!r}"
    return text


@pytest.fixture(scope="module")
def server():
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "2048") as s:
        yield s


# --- openai-agents -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def agents(server):
    agents = pytest.importorskip("agents")
    pytest.importorskip("openai")
    agents.set_tracing_disabled(True)
    client = api_client(server.url, asynchronous=True)
    return agents, client


AGENTS_MODELS = ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"]   # the first is the library's default


@pytest.mark.parametrize("model_class", AGENTS_MODELS)
def test_openai_agents_structured_output(server, agents, model_class):
    agents, client = agents
    model = getattr(agents, model_class)(model=server.model, openai_client=client)
    agent = agents.Agent(name="cats", instructions="Answer as JSON.", model=model, output_type=Cat,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
    result = agents.Runner.run_sync(agent, "Describe a cat.")
    assert isinstance(result.final_output, Cat)
    Cat.model_validate(result.final_output.model_dump())


@pytest.mark.parametrize("model_class", AGENTS_MODELS)
def test_openai_agents_tool_loop(server, agents, model_class):
    agents, client = agents
    model = getattr(agents, model_class)(model=server.model, openai_client=client)
    weather = Weather()

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return weather(city)

    # "required" on the first turn; reset_tool_choice (the default) makes it "auto" after the call
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=model, tools=[get_weather],
                         reset_tool_choice=True,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS,
                                                             tool_choice="required"))
    result = agents.Runner.run_sync(agent, QUESTION, max_turns=3)
    sent = [json.loads(i.raw_item.arguments) for i in result.new_items if isinstance(i, agents.ToolCallItem)]
    weather.check(sent)
    jsonschema.validate(sent[0], get_weather.params_json_schema)
    assert any(isinstance(i, agents.ToolCallOutputItem) for i in result.new_items)
    assert isinstance(result.new_items[-1], agents.MessageOutputItem)
    final_text(result.final_output)


# --- pydantic-ai ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pydantic_ai(server):
    pytest.importorskip("pydantic_ai")
    pytest.importorskip("openai")
    from pydantic_ai.providers.openai import OpenAIProvider
    client = api_client(server.url, asynchronous=True)
    return OpenAIProvider(openai_client=client)


PYDANTIC_AI_MODELS = ["OpenAIChatModel", "OpenAIResponsesModel"]


@pytest.mark.parametrize("model_class", PYDANTIC_AI_MODELS)
def test_pydantic_ai_structured_output(server, pydantic_ai, model_class):
    from pydantic_ai import Agent
    from pydantic_ai.models import openai as models
    from pydantic_ai.settings import ModelSettings
    model = getattr(models, model_class)(server.model, provider=pydantic_ai)
    # output_type=Cat in the default (tool) output mode: the model must call the final_result tool
    agent = Agent(model, output_type=Cat, model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS))
    result = agent.run_sync("Describe a cat.")
    assert isinstance(result.output, Cat)


@pytest.mark.parametrize("model_class", PYDANTIC_AI_MODELS)
def test_pydantic_ai_tool_loop(server, pydantic_ai, model_class):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models import openai as models
    from pydantic_ai.settings import ModelSettings

    @dataclass
    class CallFirst(AbstractCapability):
        """The named tool on the first step, then no tools (pydantic-ai's way to vary tool_choice per step)."""
        tool: str = "get_weather"

        def get_model_settings(self):
            return lambda ctx: ModelSettings(tool_choice=[self.tool] if ctx.run_step <= 1 else "none")

    model = getattr(models, model_class)(server.model, provider=pydantic_ai)
    agent = Agent(model, model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS), capabilities=[CallFirst()])
    weather = Weather()

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return weather(city)

    result = agent.run_sync(QUESTION)
    parts = [p for m in result.all_messages() for p in m.parts]
    weather.check([p.args_as_dict() for p in parts if isinstance(p, ToolCallPart)])
    assert any(isinstance(p, ToolReturnPart) and p.tool_name == "get_weather" for p in parts)
    final_text(result.output)


# --- langchain-openai ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_openai(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return lambda **kw: langchain_openai.ChatOpenAI(model=server.model, base_url=f"{server.url}/v1", api_key="unused",
                                                    temperature=0, max_tokens=MAX_TOKENS, max_retries=0, timeout=120,
                                                    **kw)


@pytest.mark.parametrize("use_responses_api", [False, True])
def test_langchain_structured_output(chat_openai, use_responses_api):
    llm = chat_openai(use_responses_api=use_responses_api)
    cat = llm.with_structured_output(Cat).invoke("Describe a cat as JSON.")   # method="json_schema" by default
    assert isinstance(cat, Cat)


@pytest.mark.parametrize("use_responses_api", [False, True])
def test_langchain_tool_loop(chat_openai, use_responses_api):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    weather = Weather()

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return weather(city)

    llm = chat_openai(use_responses_api=use_responses_api)
    messages = [HumanMessage(QUESTION)]
    call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    messages.append(call)
    for tool_call in call.tool_calls:
        messages.append(get_weather.invoke(tool_call))
    assert isinstance(messages[-1], ToolMessage)
    weather.check([tc["args"] for tc in call.tool_calls])
    jsonschema.validate(call.tool_calls[0]["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    final = llm.bind_tools([get_weather]).invoke(messages)
    assert isinstance(final, AIMessage) and not final.tool_calls
    final_text(final.text)


# --- instructor ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openai_client(server):
    pytest.importorskip("openai")
    return api_client(server.url)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])   # TOOLS is the default
def test_instructor_structured_output(server, openai_client, mode):
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode))
    if mode.startswith("RESPONSES"):
        cat = client.responses.create(model=server.model, input="Describe a cat.", response_model=Cat,
                                      max_output_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    else:
        cat = client.chat.completions.create(model=server.model,
                                             messages=[{"role": "user", "content": "Describe a cat."}],
                                             response_model=Cat, max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    assert isinstance(cat, Cat)


def test_instructor_tool_loop(server, openai_client):
    """instructor's function calling: the tool's arguments come back as a validated pydantic model (the named tool
    is forced), the function runs on them, and the result goes back for a plain answer."""
    instructor = pytest.importorskip("instructor")

    class GetWeather(BaseModel):
        """Current weather in a city."""
        city: str

    client = instructor.from_openai(openai_client)
    weather = Weather()
    messages = [{"role": "user", "content": QUESTION}]
    args, completion = client.chat.completions.create_with_completion(
        model=server.model, messages=messages, response_model=GetWeather, max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "GetWeather"
    jsonschema.validate(json.loads(call.function.arguments), GetWeather.model_json_schema())
    messages += [completion.choices[0].message.model_dump(),
                 {"role": "tool", "tool_call_id": call.id, "content": weather(**args.model_dump())}]
    weather.check([json.loads(call.function.arguments)])
    final = client.chat.completions.create(model=server.model, messages=messages, response_model=None,
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert not final.choices[0].message.tool_calls
    final_text(final.choices[0].message.content)


# --- litellm -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of the price list from the network
    litellm = pytest.importorskip("litellm")
    return litellm, dict(model=f"openai/{server.model}", api_base=f"{server.url}/v1", api_key="unused", temperature=0,
                         timeout=120, num_retries=0)


def test_litellm_structured_output(litellm):
    litellm, kw = litellm
    r = litellm.completion(messages=[{"role": "user", "content": "Describe a cat."}], response_format=Cat,
                           max_tokens=MAX_TOKENS, **kw)
    assert r.choices[0].finish_reason == "stop"
    Cat.model_validate_json(r.choices[0].message.content)


def test_litellm_tool_loop(litellm):
    litellm, kw = litellm
    weather = Weather()
    messages = [{"role": "user", "content": QUESTION}]
    r = litellm.completion(messages=messages, tools=[CHAT_TOOL], tool_choice="required", max_tokens=MAX_TOKENS, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    messages.append(r.choices[0].message.model_dump())
    for call in calls:
        assert call.function.name == "get_weather"
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": weather(**json.loads(call.function.arguments))})
    weather.check([json.loads(c.function.arguments) for c in calls])
    final = litellm.completion(messages=messages, tools=[CHAT_TOOL], max_tokens=MAX_TOKENS, **kw)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    final_text(final.choices[0].message.content)


def test_litellm_responses_structured_output(litellm):
    litellm, kw = litellm
    r = litellm.responses(input="Describe a cat.", text_format=Cat, max_output_tokens=MAX_TOKENS, **kw)
    assert r.status == "completed"
    (message,) = [o for o in r.output if o.type == "message"]
    Cat.model_validate_json(message.content[0].text)


def test_litellm_responses_tool_loop(litellm):
    litellm, kw = litellm
    weather = Weather()
    r = litellm.responses(input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="required",
                          max_output_tokens=MAX_TOKENS, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": weather(**json.loads(c.arguments))}
               for c in calls]
    weather.check([json.loads(c.arguments) for c in calls])
    final = litellm.responses(input=outputs, previous_response_id=r.id, tools=[RESPONSES_TOOL],
                              max_output_tokens=MAX_TOKENS, **kw)
    assert final.status == "completed" and not [o for o in final.output if o.type == "function_call"]
    final_text("".join(c.text for o in final.output if o.type == "message" for c in o.content))


# --- a forced call is calls only, seen through a library ----------------------------------------------------

def test_a_forced_call_leaves_no_text(litellm):
    litellm, kw = litellm
    chat = litellm.completion(messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL],
                              tool_choice="required", max_tokens=MAX_TOKENS, **kw)
    responses = litellm.responses(input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="required",
                                  max_output_tokens=MAX_TOKENS, **kw)
    assert chat.choices[0].message.tool_calls and not chat.choices[0].message.content
    assert [o.type for o in responses.output] == ["function_call"]

