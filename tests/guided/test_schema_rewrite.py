"""Schemas rewritten before the keyword check and the compile (engine/guided/schema_rewrite.py): each rewrite
gives the expected schema, accepts the same instances, contradictions are refused naming path and reason, and
schemas once refused now guide the real model to outputs valid under the schema as given."""
import json

import jsonschema
import pytest
import xgrammar as xgr

from engine.guided.compiler import tokenizer_info
from engine.guided.schema_rewrite import MAX_MERGES, rewrite_schema
from engine.guided.guide import grammar_schema
from engine.requests.sequence import SamplingParams

INT, STR = {"type": "integer"}, {"type": "string"}
BASE = {"type": "object", "properties": {"id": STR, "tags": {"type": "array", "items": STR, "maxItems": 8}},
        "required": ["id"]}

# (schema, the rewritten schema)
REWRITES = {
    "allOf objects": (
        {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                   {"type": "object", "properties": {"b": STR}, "required": ["b"]}]},
        {"type": "object", "required": ["a", "b"], "properties": {"a": INT, "b": STR}}),
    "shared property merged": (
        {"allOf": [{"properties": {"n": {"type": "number", "minimum": 0, "maximum": 10}}},
                   {"properties": {"n": {"type": "integer", "minimum": 2, "exclusiveMaximum": 9}}}]},
        {"properties": {"n": {"type": "integer", "minimum": 2, "maximum": 10, "exclusiveMaximum": 9}}}),
    "enums intersected": (
        {"allOf": [{"enum": ["a", "b", 1]}, {"type": "string"}, {"enum": ["b", "a", "c"]}]},
        {"type": "string", "enum": ["a", "b"]}),
    "strings and arrays tightened": (
        {"allOf": [{"type": "string", "minLength": 2, "maxLength": 9}, {"minLength": 4, "maxLength": 12}]},
        {"type": "string", "minLength": 4, "maxLength": 9}),
    "additionalProperties false": (
        {"allOf": [{"type": "object", "properties": {"a": INT}, "additionalProperties": False},
                   {"properties": {"a": {"minimum": 1}, "b": INT}}]},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}, "additionalProperties": False}),
    "additionalProperties schema": (
        {"allOf": [{"type": "object", "properties": {"a": INT}, "additionalProperties": {"type": "integer"}},
                   {"properties": {"b": {"maximum": 3}}}]},
        {"type": "object", "properties": {"a": INT, "b": {"type": "integer", "maximum": 3}},
         "additionalProperties": {"type": "integer"}}),
    "$ref base + extension": (
        {"$defs": {"base": BASE}, "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"n": INT}, "required": ["n"]}]},
        {"$defs": {"base": BASE}, "type": "object", "required": ["id", "n"],
         "properties": {**BASE["properties"], "n": INT}}),
    "siblings into anyOf": (
        {"type": "integer", "minimum": 5, "anyOf": [{"maximum": 10}, STR]},
        {"anyOf": [{"type": "integer", "minimum": 5, "maximum": 10}]}),
    "tagged oneOf": (
        {"type": "object", "required": ["kind"],
         "oneOf": [{"properties": {"kind": {"const": "a"}, "x": INT}}, {"properties": {"kind": {"const": "b"}}}]},
        {"anyOf": [{"type": "object", "required": ["kind"], "properties": {"kind": {"const": "a"}, "x": INT}},
                   {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "b"}}}]}),
    "oneOf of types": ({"oneOf": [INT, STR, {"type": ["null", "boolean"]}]},
                       {"anyOf": [INT, STR, {"type": ["null", "boolean"]}]}),
    "required outside properties": (
        {"type": "object", "properties": {"a": INT}, "required": ["a", "b"], "additionalProperties": STR},
        {"type": "object", "properties": {"a": INT, "b": STR}, "required": ["a", "b"], "additionalProperties": STR}),
    "dependencies": (
        {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a"],
         "dependencies": {"a": ["b"], "c": []}},
        {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a", "b"]}),
    "dependentRequired": (
        {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}, "required": ["a"]},
        {"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a", "b"]}),
    "schema dependency of a required name": (
        {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": INT}, "required": ["kind"],
         "dependencies": {"kind": {"oneOf": [{"properties": {"kind": {"const": "a"}, "x": INT}},
                                             {"properties": {"kind": {"const": "b"}}}]}}},
        {"anyOf": [{"type": "object", "required": ["kind"], "properties": {"kind": {"const": "a"}, "x": INT}},
                   {"type": "object", "required": ["kind"], "properties": {"kind": {"const": "b"}, "x": INT}}]}),
    "type list of one": ({"type": ["string"]}, STR),
    "recursive $ref stays": (
        {"$defs": {"n": {"type": "object", "properties": {"c": {"allOf": [
            {"$ref": "#/$defs/n"}, {"required": ["c"]}]}}}},
         "$ref": "#/$defs/n"},
        {"$defs": {"n": {"type": "object", "properties": {"c": {"allOf": [
            {"$ref": "#/$defs/n"}, {"required": ["c"], "properties": {"c": {}}}]}}}}, "$ref": "#/$defs/n"}),
    "different patterns stay": ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]},
                                {"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}),
}
INSTANCES = [None, True, 0, 1, 2.5, 3, 6, 9, 11, -1, "", "a", "ab", "abcd", "b", [], ["x"], {}, {"a": 1},
             {"a": 1, "b": "x"}, {"a": 1, "b": 2}, {"a": 0, "b": 2}, {"id": "1"}, {"id": "1", "n": 2},
             {"kind": "a", "x": 1}, {"kind": "b"}, {"kind": "c"}, {"n": 2}, {"n": 9}, {"n": 10}, {"n": 2.5},
             {"a": 1, "c": 3}, {"c": {"c": {}}}]


@pytest.mark.parametrize("name", list(REWRITES))
def test_rewrite(name):
    schema, expected = REWRITES[name]
    original = json.dumps(schema)
    assert rewrite_schema(schema) == expected
    assert json.dumps(schema) == original, "the schema given was modified"


@pytest.mark.parametrize("name", list(REWRITES))
def test_rewrite_accepts_the_same_instances(name):
    schema, _ = REWRITES[name]
    cls = jsonschema.Draft7Validator if "dependencies" in schema else jsonschema.Draft202012Validator
    before, after = (cls(s) for s in (schema, rewrite_schema(schema)))
    for value in INSTANCES:
        assert before.is_valid(value) == after.is_valid(value), value


@pytest.mark.parametrize("schema, where, why", [
    ({"allOf": [STR, INT]}, "#/allOf", "types have nothing in common"),
    ({"type": "object", "properties": {"c": {"allOf": [{"enum": [1, 2]}, {"const": 3}]}}},
     "#/properties/c/allOf", "no value is allowed by every branch's `enum`/`const`"),
    ({"allOf": [{"type": "object", "properties": {"a": INT}, "additionalProperties": False},
                {"required": ["b"]}]}, "#/allOf", "required property 'b'"),
    ({"type": "array", "allOf": [{"minItems": 3}, {"maxItems": 2}]}, "#/allOf", "`minItems` 3 is above `maxItems` 2"),
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": False, "required": ["b"]},
     "#/required", "'b' is required but `additionalProperties` is false"),
    ({"type": "integer", "oneOf": [STR, {"type": "boolean"}]}, "#", "no branch of its `oneOf`"),
])
def test_contradictions_are_refused_with_path_and_reason(schema, where, why):
    with pytest.raises(ValueError, match="can match nothing") as err:
        SamplingParams(json_schema=schema)
    assert f"{where}: " in str(err.value) and why in str(err.value), str(err.value)


def test_what_cannot_be_written_is_left_for_the_check():
    schema = {"type": "object", "properties": {"p": {"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}}}
    with pytest.raises(ValueError, match=r"cannot enforce.*#/properties/p/allOf: `allOf` of 2"):
        SamplingParams(json_schema=schema, guided_backend="xgrammar")
    assert SamplingParams(json_schema=schema).guide.backend == "llguidance"      # auto: llguidance intersects it


def test_reference_into_a_node_keeps_it():
    schema = {"properties": {"x": {"allOf": [{"properties": {"a": INT}}, {"required": ["a"]}]},
                             "y": {"$ref": "#/properties/x/allOf/0"}}}
    assert rewrite_schema(schema) == {**schema, "properties": {**schema["properties"], "x": {
        "allOf": [{"properties": {"a": INT}}, {"required": ["a"], "properties": {"a": {}}}]}}}


def test_reference_bomb_is_bounded():
    defs = {"d0": {"type": "object", "properties": {"v": INT}}}
    for i in range(1, 40):
        defs[f"d{i}"] = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"$ref": f"#/$defs/d{i - 1}"}]}
    rewrite_schema({"$defs": defs, "$ref": "#/$defs/d39"})     # returns: the merge budget stops the doubling
    assert MAX_MERGES < 2 ** 39


# ---- schemas once refused, now guiding the real model -------------------------------------------------
ADDRESS = {"type": "object", "properties": {"street": STR, "city": STR}, "required": ["street", "city"]}
AGENT_SCHEMAS = {
    "allOf base + extension": {
        "$defs": {"base": {"type": "object", "properties": {"id": STR, "priority": {"enum": ["low", "high"]}},
                           "required": ["id"]}},
        "allOf": [{"$ref": "#/$defs/base"},
                  {"properties": {"title": {"type": "string", "maxLength": 40}, "done": {"type": "boolean"}},
                   "required": ["title", "done"]}]},
    "allOf closed object": {
        "allOf": [{"type": "object", "properties": {"city": STR, "days": {"type": "integer", "minimum": 1}},
                   "required": ["city"], "additionalProperties": False},
                  {"properties": {"days": {"maximum": 7}}, "required": ["days"]}]},
    "discriminated oneOf": {
        "type": "object", "required": ["action"],
        "oneOf": [{"properties": {"action": {"const": "search"}, "query": STR}, "required": ["query"]},
                  {"properties": {"action": {"const": "open"}, "url": STR}, "required": ["url"]},
                  {"properties": {"action": {"const": "stop"}}}]},
    "required from another branch": {
        "type": "object", "properties": {"shipping": {"allOf": [{"$ref": "#/definitions/address"},
                                                                {"properties": {"kind": {"enum": ["home", "work"]}},
                                                                 "required": ["kind"]}]}},
        "required": ["shipping"], "definitions": {"address": ADDRESS}},
}


@pytest.mark.parametrize("schema", list(AGENT_SCHEMAS.values()), ids=list(AGENT_SCHEMAS))
def test_agent_schemas_were_refused_and_are_now_exact(schema):
    from engine.guided.schema_check import unenforced_keywords
    assert unenforced_keywords(schema), "refused before the rewrite"
    assert unenforced_keywords(grammar_schema(schema)) == []


@pytest.fixture(scope="module")
def compiler(engine):
    return xgr.GrammarCompiler(tokenizer_info(engine.tokenizer, engine.runner.vocab, engine.eos_ids))


def test_grammar_enforces_what_the_original_keywords_meant(compiler):
    from engine.guided.compiler import compile_guide
    params = SamplingParams(json_schema=AGENT_SCHEMAS["allOf closed object"])
    matcher = xgr.GrammarMatcher(compile_guide(compiler, params.guide), terminate_without_stop_token=True)
    assert not matcher.accept_string('{"city": "Oslo"}') or not matcher.is_completed()    # days is required
    matcher = xgr.GrammarMatcher(compile_guide(compiler, params.guide), terminate_without_stop_token=True)
    assert not matcher.accept_string('{"city": "Oslo", "days": 8}')                        # days <= 7


def test_greedy_outputs_validate_against_the_original_schema(engine):
    names = list(AGENT_SCHEMAS)
    prompts = [engine.apply_chat_template([{"role": "user", "content": f"Answer in JSON matching {json.dumps(s)}"}])
               for s in AGENT_SCHEMAS.values()]
    params = [SamplingParams(max_tokens=120, temperature=0, json_schema=s) for s in AGENT_SCHEMAS.values()]
    assert all(json.loads(p.json_schema) == s for p, s in zip(params, AGENT_SCHEMAS.values())), "the original stays"
    seqs = engine.generate(prompts, params)
    for name, schema, seq in zip(names, AGENT_SCHEMAS.values(), seqs):
        assert seq.finish_reason == "stop", (name, seq.finish_reason, seq.text)
        jsonschema.validate(json.loads(seq.text), schema)
