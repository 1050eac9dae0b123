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
from engine.requests.sequence import SamplingParams
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
    "dependencies": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                     "properties": {"name": NAME, "age": NUM, "email": {"type": "string", "maxLength": 20}},
                     "required": ["name"], "dependencies": {"age": {"properties": {"email": {"maxLength": 8}},
                                                                    "required": ["email"]}}},
    "overlapping oneOf": {"type": "object", "properties": {"shape": {"enum": ["circle", "rectangle"]}, "radius": NUM,
                                                          "length": NUM, "width": NUM},
                          "required": ["shape"],
                          "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]},
    "not required": {"type": "object", "properties": {"a": NUM, "b": NUM, "c": NUM}, "required": ["a", "b"],
                     "not": {"required": ["b", "c"]}},
    "lengths beside a pattern, multipleOf": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]+$", "minLength": 2, "maxLength": 4},
        "price": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 100}}, "required": ["code", "price"]},
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
    ({"type": "object", "properties": {"a": NUM}, "if": {"required": ["a"]},
      "then": {"properties": {"a": {"maximum": 3}}}},
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
    work = [(0, prompt, params(SCHEMAS[n])) for n in names] + [
        (0, prompt, params(CAT)), (1, prompt, SamplingParams(max_tokens=24, temperature=0))]
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


def test_llguidance_reads_every_token_as_the_tokenizer_decodes_it(engine):
    """Both backends see each token as the bytes the tokenizer decodes it to (special tokens: never text).
    llguidance's own reading of a converted GGUF tokenizer's JSON kept byte-level characters ('Ġ' for a space)
    under some transformers versions, and its rows were then rejected a few tokens in."""
    svc = service(engine)
    lt, tok, vocab = svc.llg_tokenizer(), engine.tokenizer, engine.runner.vocab
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert lt.vocab_size == vocab
    decoded, checked = svc.info.decoded_vocab, 0            # (the property builds the whole list each time)
    for t in range(vocab):
        xgr_bytes, llg_bytes = bytes(decoded[t]), lt.decode([t])
        if t in special:
            assert not xgr_bytes and not llg_bytes and lt.decode([t], special=True), t
            continue
        assert llg_bytes == xgr_bytes, (t, llg_bytes, xgr_bytes)
        try:
            text = xgr_bytes.decode("utf-8")
        except UnicodeDecodeError:                  # part of a character: no text of its own to compare
            continue
        assert tok.decode([t]) == text, (t, tok.decode([t]), text)
        checked += 1
    assert checked > 0.9 * vocab


def test_llguidance_rows_take_the_native_node_not_python(engine, prompt, alone, monkeypatch):
    """No Python in the grammar callback: llguidance rows run in the node's C++ (a Python callback would fail)."""
    from engine.guided.masks import GrammarMasks
    monkeypatch.setattr(GrammarMasks, "run_python", lambda self: 1 / 0)
    names = ["overlapping oneOf", "not required"]
    got = drive(engine, [(0, prompt, params(SCHEMAS[n])) for n in names] + [(0, prompt, params(CAT))])
    assert [s.error for s in got] == [None] * 3
    assert [s.output_token_ids for s in got[:2]] == [alone[n].output_token_ids for n in names]


@pytest.mark.parametrize("cfg", [
    dict(grammar_node="python"),
    dict(speculative="eagle", num_speculative_tokens=3, guided_draft_masks=True, guided_forced_drafts=True),
    dict(speculative="draft_model", spec_draft_model="default", num_speculative_tokens=2, guided_draft_masks=True)],
    ids=["python path", "eagle draft masks + forced drafts", "draft model draft masks"])
def test_llguidance_rows_on_every_path_give_the_same_tokens(prompt, alone, cfg):
    """The Python grammar path, and speculation whose drafts walk llguidance's draft masks (forced drafts from
    its jump-forward text), give the tokens of the native node without speculation."""
    eng = LLMEngine(**(CPU | dict(max_num_seqs=4, spec_min_acceptance=0.0) | cfg))
    names = ["dependentSchemas", "overlapping oneOf", "patternProperties"]
    got = drive(eng, [(0, prompt, params(SCHEMAS[n])) for n in names])
    assert_no_leak(eng)
    for name, seq in zip(names, got):
        assert seq.output_token_ids == alone[name].output_token_ids, seq.text
    assert "speculative" not in cfg or eng.timings.spec_rows > 0
