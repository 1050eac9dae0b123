"""/v1/responses through the official openai client (CPU, real HTTP): text, streamed events, a JSON schema
format, a function-tool loop with previous_response_id, and the errors."""
import json

import jsonschema
import openai
import pytest

from serving import CPU_ARGS, serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER,
        "strict": True}
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "1024") as s:
        yield s


def test_text_equals_the_chat_endpoints(server, client):
    r = client.responses.create(model=server.model, input="Name three colours.", instructions="Answer briefly.",
                                max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=server.model, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_build_the_same_text(server, client):
    kw = dict(model=server.model, input="Name three colours.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text


def test_a_json_schema_format(server, client):
    r = client.responses.create(model=server.model, input="Describe a cat as JSON.", max_output_tokens=64,
                                temperature=0, text={"format": {"type": "json_schema", "name": "cat", "schema": CAT}})
    jsonschema.validate(json.loads(r.output_text), CAT)
    assert r.status == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_with_previous_response_id(server, client, stream):
    kw = dict(model=server.model, tools=[TOOL], tool_choice="required", max_output_tokens=48, temperature=0)
    if stream:
        events = list(client.responses.create(input="What is the weather in Paris?", stream=True, **kw))
        first = events[-1].response
        assert "response.function_call_arguments.done" in [e.type for e in events]
    else:
        first = client.responses.create(input="What is the weather in Paris?", **kw)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    second = client.responses.create(model=server.model, previous_response_id=first.id, max_output_tokens=24,
                                     temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                            "output": "Sunny, 21 C"}])
    assert second.output_text and second.previous_response_id == first.id


def test_errors_in_openai_shape(server, client):
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|is not found"):
        client.responses.create(model=server.model, input="hi", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError, match="function tools only"):
        client.responses.create(model=server.model, input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-17", input="hi")
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(model=server.model, input=[{"type": "image", "url": "x"}])


def test_a_forced_call_cut_in_the_next_one_is_calls_only(server, client):
    """The model goes on calling after its first call (parallel calls allowed) and the length limit cuts the next
    one, which begins with the "\\n" separator: the output is the whole call, no text, on both APIs (the cut
    call is dropped)."""
    question, tool = "What is the weather in Paris?", {k: v for k, v in TOOL.items() if k != "type"}
    kw = dict(model=server.model, temperature=0, tools=[{"type": "function", "function": tool}],
              tool_choice="required", max_tokens=48, messages=[{"role": "user", "content": question}])
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content is None and r.usage.completion_tokens == 48
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [tc.function.arguments for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []] == \
        [r.choices[0].message.tool_calls[0].function.arguments]
    rkw = dict(model=server.model, input=question, tools=[TOOL], tool_choice="required", max_output_tokens=48,
               temperature=0)
    whole = client.responses.create(**rkw)
    assert [o.type for o in whole.output] == ["function_call"] and whole.usage.output_tokens == 48
    events = list(client.responses.create(stream=True, **rkw))
    assert not [e for e in events if e.type.startswith("response.output_text")]
    assert [o.type for o in events[-1].response.output] == ["function_call"]


def test_truncation_reasoning_and_include_are_honoured_or_refused(server, client):
    kw = dict(model=server.model, input="Hi", max_output_tokens=4, temperature=0)
    r = client.responses.create(truncation="disabled", reasoning={"effort": "none"},
                                include=["reasoning.encrypted_content", "file_search_call.results"], **kw)
    assert r.truncation == "disabled" and r.status == "incomplete" and r.output_text
    for fields, param in ((dict(truncation="auto"), "truncation"),
                          (dict(reasoning={"effort": "high"}), "reasoning.effort"),
                          (dict(reasoning={"summary": "auto"}), "reasoning.summary"),
                          (dict(include=["reasoning.encrypted_content", "nope"]), "include[1]")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(**fields, **kw)
        assert err.value.body["param"] == param, fields


def test_logprobs_on_the_output_text_equal_the_chat_endpoints(server, client):
    kw = dict(model=server.model, input="Name three colours.", max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=server.model,
                                          messages=[{"role": "user", "content": "Name three colours."}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    # the later requests find the first one's prompt pages in the prefix cache: a prefill of fewer tokens rounds
    # differently in float32, so the values agree to a tolerance and the tokens exactly
    want = [(c.token, c.logprob, [t.token for t in c.top_logprobs]) for c in chat.choices[0].logprobs.content]

    def check(entries):
        got = [(c.token, c.logprob, [t.token for t in c.top_logprobs]) for c in entries]
        assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want]
        assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    check(client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw).output[0]
          .content[0].logprobs)
    done = list(client.responses.create(stream=True, include=["message.output_text.logprobs"], top_logprobs=2, **kw))
    check(done[-1].response.output[0].content[0].logprobs)
