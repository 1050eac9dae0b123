"""The llguidance backend (engine/guided/llg.py): JSON schemas xgrammar cannot enforce run on llguidance's
matcher through the Python grammar path, greedy outputs validate against the schema as written, the backend is
chosen per request (auto / named), what neither enforces is refused naming it, llguidance rows batch with
xgrammar and plain rows token for token, and speculation (n-gram, K = 2: the rollback path) changes no token."""
import json

import jsonschema
import pytest

from conftest import assert_no_leak
from engine.guided.llg import LLGMatcher, prepare
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from helpers import CAT, CPU, allowed, drive, service

NUM = {"type": "integer", "minimum": 0, "maximum": 99}
NAME = {"type": "string", "maxLength": 10}
# each refused for xgrammar (its check names the keyword), enforced by llguidance
SCHEMAS = {
    "two patterns": {"type": "object", "properties": {"code": {"type": "string", "allOf": [
        {"pattern": "^[A-Z]+$"}, {"pattern": "^.{2,4}$"}]}}, "required": ["code"]},
    "patternProperties": {"type": "object", "allOf": [
        {"properties": {"name": NAME}, "required": ["name"]},
        {"properties": {"name": True}, "patternProperties": {"^x_[a-z]{1,4}$": NUM}, "additionalProperties": False,
         "maxProperties": 2}]},
    "dependentSchemas": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]}, "days": NUM},
                         "required": ["city"], "dependentSchemas": {"days": {"required": ["unit"]}},
                         "dependentRequired": {"unit": ["days"]}},
    "dependencies": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"name": NAME, "age": NUM, "email": {"type": "string", "maxLength": 20}},
                     "required": ["name"], "dependencies": {"age": {"properties": {"email": {"maxLength": 8}},
                                                                    "required": ["email"]}}},
    "overlapping oneOf": {"type": "object", "properties": {"shape": {"enum": ["circle", "rectangle"]}, "radius": NUM,
                                                          "length": NUM, "width": NUM},
                          "required": ["shape"], "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]},
    "not required": {"type": "object", "properties": {"a": NUM, "b": NUM, "c": NUM}, "required": ["a", "b"],
                     "not": {"required": ["b", "c"]}},
}
ASK = "Give me a small JSON object."


def params(schema, **kw):
    return SamplingParams(max_tokens=48, temperature=0, json_schema=schema, **kw)


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.apply_chat_template([{"role": "user", "content": ASK}])


@pytest.fixture(scope="module")
def alone(engine, prompt):
    """Each llguidance schema's greedy output, one request at a time."""
    return {name: engine.generate([prompt], params(s))[0] for name, s in SCHEMAS.items()}


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_xgrammar_refuses_runs_on_llguidance_and_its_output_validates(alone, name):
    schema = SCHEMAS[name]
    assert params(schema).guide.backend == "llguidance"
    with pytest.raises(ValueError, match="cannot enforce"):
        params(schema, guided_backend="xgrammar")
    seq = alone[name]
    assert seq.error is None and seq.finish_reason == "stop", (seq.error, seq.text)
    jsonschema.validate(json.loads(seq.text), schema)


def test_presence_rewrite_is_exact_on_every_combination():
    """`prepare`'s schema accepts the same closed objects as the schema as written."""
    import itertools
    for name in ("dependentSchemas", "overlapping oneOf", "not required", "dependencies"):
        schema = SCHEMAS[name]
        props, check = list(schema["properties"]), jsonschema.validators.validator_for(schema)
        for keep in itertools.product((False, True), repeat=len(props)):
            value = {p: ("c" if p == "unit" else "ab" if schema["properties"][p].get("type") == "string"
                         else "circle" if p == "shape" else 1) for p, k in zip(props, keep) if k}
            assert check(prepare(schema)).is_valid(value) == check(schema).is_valid(value), (name, value)


def test_explicit_backend_and_bad_values():
    assert params(CAT).guide.backend == "xgrammar"
    assert params(CAT, guided_backend="llguidance").guide.backend == "llguidance"
    assert SamplingParams(regex="[a-z]+", guided_backend="llguidance").guide.backend == "llguidance"
    with pytest.raises(ValueError, match="guided_backend must be one of"):
        params(CAT, guided_backend="outlines")
    with pytest.raises(ValueError, match="ebnf runs on xgrammar"):
        SamplingParams(ebnf='root ::= "a"', guided_backend="llguidance")


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}, "required": ["a"]},
     ["#/properties/a/not", "llguidance cannot enforce it either", "not"]),
    ({"type": "object", "properties": {"a": NUM}, "if": {"required": ["a"]}, "then": {"properties": {"a": {"maximum": 3}}}},
     ["#/if", "llguidance cannot enforce it either", "if"]),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, ["#/oneOf", "oneOf"]),
])
def test_schema_neither_backend_enforces_is_refused_naming_it(schema, words):
    with pytest.raises(ValueError) as err:
        params(schema)
    for word in words:
        assert word in str(err.value)


def test_matcher_keeps_xgrammars_semantics(engine):
    """A rejected token leaves the state as it was; EOS terminates only where the grammar may end, and
    rolls back; special tokens never appear inside a string."""
    g = service(engine).compile_now(params(CAT, guided_backend="llguidance").guide)
    m, tok, eos = g.matcher(), engine.tokenizer, sorted(engine.eos_ids)[0]
    assert isinstance(m, LLGMatcher)
    assert not m.accept_token(tok.encode("hello", add_special_tokens=False)[0]) and not m.accept_token(eos)
    ids = tok.encode('{"name": "Tom', add_special_tokens=False)
    assert all(m.accept_token(i) for i in ids)
    assert not allowed(m, engine.runner.vocab) & (set(engine.eos_ids) | {0, 1})
    rest = tok.encode('", "age": 3}', add_special_tokens=False)
    assert all(m.accept_token(i) for i in rest) and allowed(m, engine.runner.vocab) == set(engine.eos_ids)
    assert m.accept_token(eos) and m.is_terminated()
    m.rollback(2)
    assert not m.is_terminated() and m.accept_token(rest[-1]) and m.accept_token(eos)


def test_llguidance_rows_batch_with_xgrammar_and_plain_rows(engine, prompt, alone):
    names = ["overlapping oneOf", "dependentSchemas", "two patterns"]
    xgr = engine.generate([prompt], params(CAT))[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    work = [(0, prompt, params(SCHEMAS[n])) for n in names] + [(0, prompt, params(CAT)),
                                                                 (1, prompt, SamplingParams(max_tokens=24, temperature=0))]
    got = drive(engine, work)
    assert_no_leak(engine)
    for seq, ref in zip(got, [alone[n] for n in names] + [xgr, plain]):
        assert seq.output_token_ids == ref.output_token_ids, seq.text


def test_ngram_speculation_with_an_llguidance_row_changes_no_token(prompt, alone):
    """The n-gram drafter walks drafts through the llguidance matcher and rolls them back (K = 2)."""
    eng = LLMEngine(**(CPU | dict(max_num_seqs=4, speculative="ngram", num_speculative_tokens=2,
                                  spec_min_acceptance=0.0)))
    names = ["dependentSchemas", "overlapping oneOf"]
    got = drive(eng, [(0, prompt, params(SCHEMAS[n])) for n in names])
    assert_no_leak(eng)
    for name, seq in zip(names, got):
        assert seq.output_token_ids == alone[name].output_token_ids, seq.text
    assert eng.timings.spec_rows > 0


def test_a_cuda_engine_refuses_llguidance_guides_by_name():
    """On CUDA, llguidance rows' tokens were rejected after a few steps (tests/test_guided_gpu.py): a CUDA
    engine's tracker refuses them up front, and still takes xgrammar's."""
    from engine.config import EngineConfig
    from engine.guided.tracker import GuidedTracker
    tracker = GuidedTracker(None, 100, (), EngineConfig(), cuda=True)
    with pytest.raises(ValueError, match="runs only on CPU engines"):
        tracker.check_backend(params(SCHEMAS["overlapping oneOf"]).guide)
    tracker.check_backend(params(CAT).guide)
