"""Schemas xgrammar cannot enforce are refused for it when SamplingParams is built (engine/guided/schema_check.py),
and each refused keyword is one the compiler really ignores (an instance violating it passes the grammar).
With the default backend (auto) some of them run on llguidance instead (tests/guided/test_guided_llguidance.py)."""
import json
import re

import pytest
import xgrammar as xgr

from engine.guided.compiler import tokenizer_info
from engine.guided.schema_check import unenforced_keywords
from engine.requests.sequence import SamplingParams

INT = {"type": "integer"}
OBJ_AB = {"type": "object", "properties": {"a": INT, "b": INT}}
# keyword -> (schema using it, an instance that violates it)
REFUSED = {
    "not": ({"type": "integer", "not": {"const": 3}}, "3"),
    "if": ({**OBJ_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "dependentRequired": ({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependencies": ({**OBJ_AB, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]"),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]"),
    # two patterns: what engine/guided/schema_rewrite.py cannot merge exactly (it merges most allOf)
    "allOf": ({"allOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]}, '"a"'),
    "oneOf": ({"oneOf": [INT, {"type": "number"}]}, "1"),
    # with patternProperties, what a missing name may hold is not rewritten into `properties`
    "required": ({**OBJ_AB, "patternProperties": {"^x": INT}, "required": ["a", "c"]}, '{"a": 1}'),
    # what xgrammar's converter drops with a warning
    "minLength": ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"a"'),
    "maxLength": ({"type": "string", "format": "email", "maxLength": 5}, '"abcdef@x.com"'),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3"),
    "pattern": ({"type": "string", "pattern": "/^[0-9]{4}$/"}, '"/1234/"'),
    "$ref": ({"$defs": {"o": OBJ_AB}, "$ref": "#/$defs/o", "properties": {"a": INT}, "required": ["a"]}, "{}"),
    "enum": ({"type": "array", "enum": ["openid", "email"]}, '"openid"'),
    "maxItems": ({"type": "object", "properties": {"q": {"maxItems": 1}}}, '{"q": [1, 2]}'),
}


@pytest.fixture(scope="module")
def compiler(engine):
    return xgr.GrammarCompiler(tokenizer_info(engine.tokenizer, engine.runner.vocab, engine.eos_ids))


@pytest.mark.parametrize("keyword", list(REFUSED))
def test_refused_keyword_is_named_and_really_unenforced(compiler, keyword):
    schema, violating = REFUSED[keyword]
    with pytest.raises(ValueError, match=f"cannot enforce.*{re.escape(keyword)}"):
        SamplingParams(json_schema=schema, guided_backend="xgrammar")
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False),
                                 terminate_without_stop_token=True)
    assert matcher.accept_string(violating) and matcher.is_completed(), (
        f"xgrammar now enforces {keyword!r}: take it out of engine/guided/schema_check.py")


@pytest.mark.parametrize("schema", [
    {"oneOf": [INT, {"type": "string"}, {"type": "null"}]},                          # distinct types
    {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},                                # distinct constants
    {"$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}},
     "oneOf": [{"$ref": "#/$defs/cat"},                                               # a tagged union
               {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}]},
    {"allOf": [OBJ_AB]}, {"type": "array", "uniqueItems": False},
    {"type": "object", "properties": {"not": INT, "if": INT}, "required": ["not"]},   # property names, not keywords
    {"enum": [{"not": 1}], "default": {"allOf": [1, 2]}},                             # values, not schemas
    {"type": "integer", "multipleOf": 3}, {"type": "string", "maxLength": 3},
    {"type": "string", "pattern": "^$|(^(?:a|b)+$)"},                                # anchors at alternatives' ends
    {"type": "string", "pattern": "^[^$]\\^+$"},                                      # in a class, escaped
    {"$defs": {"o": OBJ_AB}, "$ref": "#/$defs/o", "description": "annotations only"},
    {"type": ["integer", "null"], "enum": [1, 2.0, None]}, {"type": "number", "enum": [1, 1.5]},
])
def test_enforceable_schemas_pass(schema):
    assert unenforced_keywords(schema) == []
    SamplingParams(json_schema=schema)


def test_message_lists_where_and_counts_the_rest():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer", "not": {"const": i}} for i in range(5)}}
    with pytest.raises(ValueError) as err:
        SamplingParams(json_schema=schema)
    assert "#/properties/p0/not" in str(err.value) and "(and 2 more)" in str(err.value)


def test_a_schema_text_is_checked_once_and_a_refusal_every_time():
    """The check of a schema's text is remembered (agents resend the same schemas); a refused schema is refused
    again, with the same message, each time it is sent."""
    from engine.guided.guide import _text_backend
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "required": ["n"]}
    first = SamplingParams(json_schema=schema).guide
    hits = _text_backend.cache_info().hits
    assert SamplingParams(json_schema=dict(schema)).guide == first
    assert _text_backend.cache_info().hits == hits + 1
    bad = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot enforce"):
            SamplingParams(json_schema=bad, guided_backend="xgrammar")
