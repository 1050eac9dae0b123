"""Guided outputs that end valid within their budget (engine/guided/closing.py): the closing text the grammar
gives completes real schemas from any prefix; at budgets down to each schema's minimum every output validates
and ends "stop"; outputs that end on their own are the same with closing on and off; the budget holds a branch
that grows the closing (an array item of required properties); the repetition guard closes a value that repeats;
a budget no output fits is refused; speculative rows close as plain ones do; a closing that ends the output takes
no step; hold() wakes where the per-step checks would act; the native closing search walks as the Python one."""
import json
import os
from pathlib import Path

import pytest
import xgrammar as xgr

from conftest import assert_no_leak
from engine.guided import _native, native
from engine.guided.closing import SLACK, Closer
from engine.guided.closing_search import (BRANCH_POINTS, BRANCHES, CANDIDATES, CLOSERS, ClosingVocab,
                                          branch_closings, closing_text, python_branch_closings, python_closing_text)
from engine.guided.compiler import compile_guide
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams

jsonschema = pytest.importorskip("jsonschema")
DATA = Path(os.environ.get("SPECDEC_DATA", Path(__file__).resolve().parents[2] / "../shared/data"))
BENCH = DATA / "jsonschemabench" / "maskbench"
if not BENCH.is_dir():                       # a bare clone: the schemas kept beside the tests
    BENCH = Path(__file__).resolve().parents[1] / "data" / "maskbench"
needs_data = pytest.mark.skipif(not BENCH.is_dir(), reason=f"no JSONSchemaBench schemas under {BENCH}")
NAMES = ["JME_0", "JME_7", "JME_17", "JME_21", "JME_38", "JME_45", "JME_52", "JME_89", "JME_91", "BFCL_simple_1",
         "BFCL_simple_68", "BFCL_simple_242", "BFCL_multiple_73"]
TEXT = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def case(name):
    data = json.loads((BENCH / f"{name}.json").read_text())
    return data["schema"], [t["data"] for t in data.get("tests", []) if t.get("valid", True)]


def available():
    return [n for n in NAMES if (BENCH / f"{n}.json").is_file()]


def prompt(engine, schema):
    return engine.apply_chat_template([{"role": "user", "content": "Produce a JSON object that matches this "
                                                                   "schema: " + json.dumps(schema)}])


def guided(engine):
    engine.guided.ensure_service()
    return engine.guided.service


def validate(seq, schema):
    assert seq.error is None, seq.error
    jsonschema.validate(json.loads(seq.text), schema)


@needs_data
def test_the_closing_text_completes_every_prefix_of_real_outputs(engine):
    """From cuts of each schema's valid example (a third, two thirds, all but its last token), the prefix plus
    the closing text parses and validates; the matcher is left where it was."""
    service = guided(engine)
    vocab = ClosingVocab(service.info)
    checked = 0
    for name in available():
        schema, examples = case(name)
        guide = SamplingParams(json_schema=schema).guide
        compiled = compile_guide(service.compiler, guide)
        for example in examples[:1]:
            text = json.dumps(example, ensure_ascii=False)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            for cut in (len(ids) // 3, 2 * len(ids) // 3, len(ids) - 1):
                matcher = xgr.GrammarMatcher(compiled)
                if not all(matcher.accept_token(t) for t in ids[:cut]):
                    break                       # compact output differs from json.dumps' spacing: stop there
                closing = closing_text(matcher)
                assert closing is not None, (name, cut)
                whole = vocab.text(ids[:cut]) + closing
                jsonschema.validate(json.loads(whole), schema)
                assert matcher.accept_string(closing) and matcher.is_completed()      # (the state it had)
                checked += 1
    assert checked >= 10


@needs_data
def test_the_native_search_walks_as_the_python_one(engine):
    """At every byte of each schema's valid example, the native closing and branches equal the Python walk's,
    and both leave the matcher where it was (the rest of the example still completes it)."""
    service = guided(engine)
    checked = 0
    for name in available():
        schema, examples = case(name)
        text = json.dumps(examples[0], separators=(",", ":")).encode() if examples else b""
        matcher = xgr.GrammarMatcher(compile_guide(service.compiler, SamplingParams(json_schema=schema).guide))
        for i in range(len(text)):
            if not matcher.accept_string(text[i:i + 1]):
                break
            closing = closing_text(matcher)
            assert closing == python_closing_text(matcher), (name, i)
            if closing:
                assert branch_closings(matcher, closing) == python_branch_closings(matcher, closing), (name, i)
            checked += 1
        else:
            assert matcher.is_completed() == bool(text), name
    assert checked >= 100
    with pytest.raises(ValueError, match="null matcher handle"):
        _native.closing_text(native.closing_search(CANDIDATES, BRANCHES, CLOSERS, BRANCH_POINTS), 0, 8)


@needs_data
@pytest.mark.parametrize("slack", [0, 6])
def test_every_output_validates_at_budgets_down_to_the_minimum(engine, slack):
    """Real schemas, max_tokens the shortest output's length (plus `slack`): every output ends "stop" within
    max_tokens and validates; closed ones say so."""
    names = available()
    schemas = [case(n)[0] for n in names]
    minima = [engine.guided.closer(compile_guide(guided(engine).compiler, SamplingParams(json_schema=s).guide),
                                   None).minimum for s in schemas]
    params = [SamplingParams(max_tokens=m + slack, temperature=0, json_schema=s) for s, m in zip(schemas, minima)]
    seqs = engine.generate([prompt(engine, s) for s in schemas], params)
    for name, s, p, seq in zip(names, schemas, params, seqs):
        assert seq.finish_reason == "stop" and len(seq.output_token_ids) <= p.max_tokens, (name, seq.text)
        validate(seq, s)
        assert seq.closed_by in (None, "budget")
    assert sum(seq.closed_by == "budget" for seq in seqs) >= len(seqs) // 2
    assert_no_leak(engine)


@needs_data
def test_outputs_that_end_on_their_own_are_the_same_with_closing_off(engine):
    """A budget some outputs reach and others do not: those that end before it (with more than the closing's
    slack to spare) are the same tokens with closing on and off; the ones cut with it off end valid with it on."""
    names = available()[:8]
    schemas = [case(n)[0] for n in names]
    prompts = [prompt(engine, s) for s in schemas]
    runs = {on: engine.generate(prompts, [SamplingParams(max_tokens=40, temperature=0, json_schema=s,
                                                         close_at_budget=on, repetition_guard=on) for s in schemas])
            for on in (False, True)}
    ended = cut = 0
    for s, off, on in zip(schemas, runs[False], runs[True]):
        if off.finish_reason == "stop" and len(off.output_token_ids) < 40 - SLACK:
            assert on.output_token_ids == off.output_token_ids and on.closed_by is None
            ended += 1
        elif off.finish_reason == "stop":
            validate(on, s)
        else:
            assert off.finish_reason == "length" and on.finish_reason == "stop" and on.closed_by == "budget"
            validate(on, s)
            cut += 1
    assert ended and cut, (ended, cut)


def test_the_budget_holds_a_branch_that_grows_the_closing(engine):
    """An array of objects: after an item, a comma opens another whose required properties the closing must then
    write. The branch's closing is longer than the closing, and it completes the grammar; from inside a string a
    comma is one more character."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"kind": {"type": "string"}, "amount": {"type": "number"}},
        "required": ["kind", "amount"]}}}, "required": ["items"]}
    compiled = compile_guide(guided(engine).compiler, SamplingParams(json_schema=schema).guide)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(b'{"items": [{"kind": "a", "amount": 1}')
    closing = closing_text(matcher)
    branches = branch_closings(matcher, closing)
    longest = max(branches, key=len)
    assert closing == b"]}" and longest.startswith(b", {") and len(longest) > len(closing) + 20
    for text in branches:
        assert matcher.accept_string(text) and matcher.is_completed()
        matcher.rollback(1)
    assert matcher.accept_string(b"]}") and matcher.is_completed()          # (the matcher is where it was)
    inside = xgr.GrammarMatcher(compiled)
    assert inside.accept_string(b'{"items": [{"kind": "ab')
    closing = closing_text(inside)
    in_string = [t for t in branch_closings(inside, closing) if t[:1] in b",{["]
    assert len(in_string) == 3 and all(t[1:] == closing for t in in_string)


@needs_data
def test_an_array_of_required_objects_closes_within_its_budget(engine):
    """JSON Mode Eval's insurance policy: the model adds array items of two required properties each until the
    budget runs out. A comma at the last free step once opened an item the closing could not finish in the
    budget left; the budget now holds that branch, and the output ends valid."""
    schema = case("JME_28")[0]
    from specdec.datasets import schema_prompt
    [seq] = engine.generate([schema_prompt(engine, schema)], SamplingParams(max_tokens=128, temperature=0,
                                                                              json_schema=schema))
    assert seq.finish_reason == "stop" and seq.closed_by == "budget", seq.text
    validate(seq, schema)
    assert seq.text.count('"coverageType"') >= 2


def test_the_repetition_guard_closes_a_repeating_string(engine):
    """logit_bias drives a string into one repeated word: the guard closes the string and the object ends
    valid; with the guard (and closing) off the same request runs to its budget, cut."""
    word = engine.tokenizer.encode(" la", add_special_tokens=False)
    assert len(word) == 1
    ask = prompt(engine, TEXT)
    on, off = engine.generate([ask, ask], [
        SamplingParams(max_tokens=120, temperature=0, json_schema=TEXT, logit_bias={word[0]: 30.0}),
        SamplingParams(max_tokens=120, temperature=0, json_schema=TEXT, logit_bias={word[0]: 30.0},
                       repetition_guard=False, close_at_budget=False)])
    assert off.finish_reason == "length" and off.closed_by is None
    assert on.finish_reason == "stop" and on.closed_by == "repetition", on.text
    validate(on, TEXT)
    assert len(on.output_token_ids) < 80 and " la la la" in on.text
    assert_no_leak(engine)


def test_a_budget_no_output_fits_fails_the_request_naming_the_minimum(engine):
    schema = {"type": "object", "properties": {"first_name": {"type": "string"}, "last_name": {"type": "string"}},
              "required": ["first_name", "last_name"]}
    too_small, cut = engine.generate([prompt(engine, schema)] * 2, [
        SamplingParams(max_tokens=3, temperature=0, json_schema=schema),
        SamplingParams(max_tokens=3, temperature=0, json_schema=schema, close_at_budget=False)])
    assert too_small.finish_reason == "error" and "max_tokens=3" in too_small.error
    assert "the shortest takes" in too_small.error and not too_small.output_token_ids
    assert cut.finish_reason == "length" and len(cut.output_token_ids) == 3
    assert_no_leak(engine)


@needs_data
@pytest.mark.parametrize("depth,k", [(1, 1), (2, 3)])
def test_speculative_rows_close_as_plain_ones(engine, depth, k):
    """n-gram speculation at tight budgets gives the plain loop's tokens, closings included: drafts never run
    past a closing decision."""
    names = available()[:6]
    schemas = [case(n)[0] for n in names]
    prompts = [prompt(engine, s) for s in schemas]
    params = [SamplingParams(max_tokens=m, temperature=0, json_schema=s) for s, m in zip(schemas, (24, 30, 36) * 2)]
    plain = engine.generate(prompts, params)
    spec = LLMEngine(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, depth=depth,
                     speculative="ngram", num_speculative_tokens=k, spec_min_acceptance=0.0)
    got = spec.generate(prompts, params)
    for a, b in zip(got, plain):
        assert (a.output_token_ids, a.finish_reason, a.closed_by) == (b.output_token_ids, b.finish_reason,
                                                                      b.closed_by), a.text
    assert any(s.closed_by == "budget" for s in got)
    assert spec.timings.spec_accepted > 0
    assert_no_leak(spec)


def test_the_guard_fires_on_a_period_and_never_on_distinct_tokens(engine):
    """The guard's run counters on their own: distinct tokens never fire it (nor put it on watch), a period-3 run
    fires it once it spans the limit, and a broken run starts again."""
    from types import SimpleNamespace as NS

    from engine.guided.closing import Closer
    service = guided(engine)
    compiled = compile_guide(service.compiler, SamplingParams(json_object=True).guide)
    closer = Closer(compiled, ClosingVocab(service.info), budget=False, guard_limit=12)
    seq = NS(output_token_ids=[])

    def commit(tokens):
        seq.output_token_ids += tokens
        closer.committed(seq, len(tokens))
    commit(list(range(100, 140)))
    assert not closer.repeating and not closer.watch
    commit([7, 8, 9] * 3 + [7])                 # period 3 over 10 tokens: watched, not yet fired
    assert closer.watch and not closer.repeating
    commit([5])                                 # broken
    assert not closer.watch and not closer.repeating
    commit([7, 8, 9] * 4)                       # 12 tokens of period 3
    assert closer.repeating


def test_the_guard_skips_only_tokens_that_change_nothing(engine):
    """Closer.committed skips the scan for a token that repeats none of the MAX_PERIOD before it while no run is
    going: over random outputs committed one token or a few at a time, its states equal a scan of every commit."""
    import random
    from types import SimpleNamespace as NS

    from engine.guided.closing import MAX_PERIOD, REPEAT_FIRED, REPEAT_WATCH, Closer, repetition_scan_py
    service = guided(engine)
    compiled = compile_guide(service.compiler, SamplingParams(json_object=True).guide)
    vocab, rng = ClosingVocab(service.info), random.Random(1)
    skipped = 0
    for case in range(40):
        closer = Closer(compiled, vocab, budget=False, guard_limit=rng.randint(6, 30))
        seq, runs, watch = NS(output_token_ids=[]), [0] * (MAX_PERIOD + 1), False
        while len(seq.output_token_ids) < 150 and not closer.repeating:
            period = rng.randint(1, MAX_PERIOD + 3)
            new = [rng.randint(0, 2 * period) for _ in range(rng.choice([1, 1, 1, 3]))]
            start = len(seq.output_token_ids)
            seq.output_token_ids += new
            skipped += len(new) == 1 and closer.quiet and new[0] not in seq.output_token_ids[-MAX_PERIOD - 1:-1]
            closer.committed(seq, len(new))
            state = repetition_scan_py(seq.output_token_ids, start, runs, closer.guard_limit, closer.watch_from, watch)
            watch = bool(state & REPEAT_WATCH) and state != REPEAT_FIRED
            assert (closer.repeating, closer.watch, closer.runs) == (state == REPEAT_FIRED, watch, runs), case
    assert skipped > 100


def test_the_native_closing_tokenizer_equals_the_python_one(engine):
    """ClosingVocab.tokens (native) gives python_tokens' longest-match tokens over closing-like texts and random
    runs of the vocabulary's pieces; a byte no token spells is refused by both."""
    import random
    service = guided(engine)
    vocab, rng = ClosingVocab(service.info), random.Random(3)
    pieces = list(vocab.ids)
    texts = [b'"}', b'"]}', b'", "name": ""}', b"0]}", b"", b"true}"]
    texts += [b"".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in texts:
        assert vocab.tokens(text) == vocab.python_tokens(text), text
    assert sum(len(vocab.tokens(t)) for t in texts) > 1000
    missing = next((bytes([b]) for b in range(256) if bytes([b]) not in vocab.ids), None)
    if missing is not None:
        for tokenize in (vocab.tokens, vocab.python_tokens):
            with pytest.raises(ValueError, match="no token spells"):
                tokenize(b"a" + missing)


def test_the_native_commit_guards_as_closer_committed(engine):
    """The native commit (engine/requests/csrc/hostpath.cpp) takes Closer.committed(seq, 1) itself: over random
    outputs one token at a time, a closer it advances keeps the fields of one Closer.committed advances."""
    import copy
    import random
    from types import SimpleNamespace as NS

    from engine.guided.closing import MAX_PERIOD, Closer
    from engine.requests import _hostpath
    service = guided(engine)
    compiled = compile_guide(service.compiler, SamplingParams(json_object=True).guide)
    vocab, rng = ClosingVocab(service.info), random.Random(2)
    native_scans = fired = 0
    for case in range(30):
        ours = Closer(compiled, vocab, budget=False, guard_limit=rng.randint(6, 30))
        theirs = copy.copy(ours)
        theirs.runs = list(ours.runs)
        seq = NS(output_token_ids=[])
        while len(seq.output_token_ids) < 150 and not theirs.repeating:
            period = rng.randint(1, MAX_PERIOD + 3)
            seq.output_token_ids.append(rng.randint(0, 2 * period))
            quiet = theirs.quiet and seq.output_token_ids[-1] not in seq.output_token_ids[-MAX_PERIOD - 1:-1]
            assert _hostpath.closer_committed(ours, seq.output_token_ids)
            native_scans += not quiet
            theirs.committed(seq, 1)
            fields = ("repeating", "watch", "quiet", "wake", "runs")
            assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields], case
        fired += theirs.repeating
    assert native_scans > 300 and fired > 1, (native_scans, fired)


def test_hold_wakes_where_the_closer_first_has_something_to_decide(engine):
    """Outside its zone a row's hold() is skipped until its next decision: the first output count at which it
    refreshes its estimate or enters the zone, found as the plain per-step checks would find it."""
    import random
    from types import SimpleNamespace as NS

    from engine.guided.closing import Closer
    service = guided(engine)
    closer = Closer(compile_guide(service.compiler, SamplingParams(json_object=True).guide),
                    ClosingVocab(service.info), budget=True, guard_limit=0)
    rng = random.Random(0)
    for _ in range(2000):
        budget, prompt = rng.randint(1, 600), [0] * rng.randint(1, 9)
        closer.estimated_at, closer.estimate, closer.reserve = rng.randint(0, budget), rng.randint(0, 99), 0
        closer.margin = rng.choice([8, 10, 14])
        seq = NS(max_len=len(prompt) + budget, prompt_token_ids=prompt)
        flight = 1 + closer.spec_k              # the most tokens a row can have in flight at a plan
        first = next(out for out in range(closer.estimated_at, budget + 400)
                     if out - closer.estimated_at >= max(1, (budget - flight - out - closer.need - closer.margin) // 2)
                     or budget - flight - out <= closer.need + closer.margin)
        assert max(closer._next_decision(seq), closer.estimated_at) == first


def test_the_native_repetition_scan_equals_the_python_one():
    """Random outputs of few distinct tokens (runs of every period up to MAX_PERIOD and past it), committed in
    chunks of 1-4 tokens as speculative steps commit them: the native scan leaves the same run counters and
    returns the same state as repetition_scan_py, watch carried between calls as Closer.committed carries it."""
    import random

    from engine.guided.closing import MAX_PERIOD, REPEAT_FIRED, REPEAT_WATCH, repetition_scan_py
    rng = random.Random(0)
    fired = watched = 0
    for case in range(300):
        limit = rng.randint(2, 40)
        watch_from = limit - 2 - 2 * rng.randint(0, 3)
        out, runs_py, runs_c, watch = [], [0] * (MAX_PERIOD + 1), [0] * (MAX_PERIOD + 1), False
        while len(out) < 120:
            period = rng.randint(1, MAX_PERIOD + 2)
            pattern = [rng.randint(0, 5) for _ in range(period)]
            new = (pattern * rng.randint(1, 8))[:rng.randint(1, 4)] if rng.random() < 0.7 else \
                [rng.randint(0, 5000) for _ in range(rng.randint(1, 4))]
            start = len(out)
            out += new
            got = _native.repetition_scan(out, start, runs_c, limit, watch_from, watch)
            want = repetition_scan_py(out, start, runs_py, limit, watch_from, watch)
            assert (got, runs_c) == (want, runs_py), (case, out, start)
            fired, watched = fired + (got == REPEAT_FIRED), watched + bool(got & REPEAT_WATCH)
            watch = bool(got & REPEAT_WATCH) and got != REPEAT_FIRED
    assert fired > 50 and watched > 50          # both outcomes were met often


@needs_data
def test_a_closing_that_ends_the_output_takes_no_step(engine, monkeypatch):
    """Outputs closed by their budget end with the tokens that stepping through the closing gives (a token a step,
    as a request with logprobs still does), but the closing itself takes no step: the host commits it whole."""
    names = available()[:4]
    schemas = [case(n)[0] for n in names]
    params = [SamplingParams(max_tokens=m, temperature=0, json_schema=s) for s, m in zip(schemas, (24, 30, 36, 24))]

    def one_by_one():
        out = []
        for s, p in zip(schemas, params):
            engine.timings.reset()
            [seq] = engine.generate([prompt(engine, s)], [p])
            out.append((seq, engine.timings.steps))
        return out

    at_once = one_by_one()
    monkeypatch.setattr(Closer, "closes_now", lambda self, seq: False)
    stepped = one_by_one()
    closed = 0
    for name, (a, steps_a), (b, steps_b) in zip(names, at_once, stepped):
        assert (a.output_token_ids, a.finish_reason, a.closed_by) == (b.output_token_ids, b.finish_reason,
                                                                      b.closed_by), name
        if a.closed_by == "budget":
            closed += 1
            forced = len(a.output_token_ids) - a.closer.start
            assert forced >= 2 and steps_a <= a.closer.start + 1 and steps_b >= steps_a + forced - 1, \
                (name, forced, steps_a, steps_b)
        else:
            assert steps_a == steps_b, name
    assert closed >= 2
    assert_no_leak(engine)
