"""Tool schemas over HTTP with the openai client: a refused schema names its field (`tools[i].function.parameters`,
not `response_format`), whether the keyword check, the rewrite or a bound of the whole call grammar refuses it;
and a composed schema once refused (allOf of a $ref'd base and an extension) now guides a call whose arguments
match the schema as given."""
import json

import jsonschema
import openai
import pytest
from serving import CPU_ARGS, api_client, serve

INT = {"type": "integer"}
PLAIN = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TASK = {"$defs": {"base": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/base"},
                  {"properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 60}},
                   "required": ["minutes"]}]}
MANY = {"type": "object", "properties": {"unit": {"enum": [f"u{i}" for i in range(20)]}}}     # over --guide-max-enum


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def client():
    with serve(*CPU_ARGS, "--max-num-seqs", "4", "--max-model-len", "512", "--guide-max-enum", "16",
               "--served-model-name", "smol") as s:
        yield api_client(s.url, timeout=300)


def ask(client, **kw):
    return client.chat.completions.create(model="smol", max_tokens=64, temperature=0,
                                          messages=[{"role": "user", "content": "Start a 5 minute timer, id t1."}],
                                          **kw)


@pytest.mark.parametrize("parameters, param, words", [
    ({"type": "object", "properties": {"a": INT}, "not": {"required": ["a"]}},
     "tools[1].function.parameters", "cannot enforce"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, INT]}}},
     "tools[1].function.parameters", "#/properties/a/allOf: the branches' types have nothing in common"),
    (MANY, "tools[1].function.parameters", "guide_max_enum"),
])
def test_a_tool_schema_refusal_names_the_tool(client, parameters, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, tools=[tool("ok", PLAIN), tool("bad", parameters)], tool_choice="required")
    assert err.value.param == param and words in err.value.message, (err.value.param, err.value.message)


def test_a_response_format_refusal_still_names_the_response_format(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": MANY}}
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, tools=[tool("ok", PLAIN)], tool_choice="auto", response_format=fmt)
    assert err.value.param == "response_format" and "guide_max_enum" in err.value.message, err.value.message


def test_a_composed_schema_guides_a_call_valid_under_the_original(client):
    reply = ask(client, tools=[tool("start_timer", TASK)], tool_choice="required")
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "start_timer"
    jsonschema.validate(json.loads(call.function.arguments), TASK)
