"""Guided decoding on the CPU: the tokenizer info, bad input (caught at SamplingParams or add_request, or failing
its request alone inside a step), the mask callback's stale-queue rule, grammars that compile while their request
prefills, and what each guide kind yields. tests/guided/test_guided_reference.py: equality with transformers + xgrammar,
schema validity, and the pipelined loop's snapshots (depth 1 vs 2, graph layout, preemption)."""
import concurrent.futures
import json
import re
import threading

import numpy as np
import pytest
import torch
import xgrammar as xgr

from conftest import assert_no_leak
from engine.guided.compiler import GrammarService, GuidedRequest
from engine.guided.masks import GrammarMasks
from engine.guided.matching import GuidedRow
from engine.guided.snapshot import Snapshot
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CAT, CPU, UNGUIDED, Exploding, allowed, drive_hooked, service

_alone: dict = {}


def alone(engine, prompt, params):
    """Output tokens of a request run by itself on the shared engine (cached)."""
    key = (tuple(prompt), params)
    if key not in _alone:
        _alone[key] = engine.generate([prompt], params)[0].output_token_ids
    return _alone[key]


# ---- tokenizer info -------------------------------------------------------------------------------
def test_special_tokens_never_inside_a_json_string_and_eos_only_after_a_complete_object(engine):
    svc, vocab = GrammarService(engine.tokenizer, engine.runner.vocab, engine.eos_ids), engine.runner.vocab
    special = {i for i, t in engine.tokenizer.added_tokens_decoder.items() if t.special and i < vocab}
    assert special, "the default model has special tokens (<|im_start|>, ...)"
    string = xgr.GrammarMatcher(svc.compile_now(SamplingParams(json_schema={"type": "string"}).guide))
    assert string.accept_string('"')
    inside = allowed(string, vocab)
    assert len(inside) > vocab // 2 and not inside & special, sorted(inside & special)
    obj = xgr.GrammarMatcher(svc.compile_now(SamplingParams(json_object=True).guide))
    assert obj.accept_string("{}")
    assert allowed(obj, vocab) == {i for i in engine.eos_ids if i < vocab}
    svc.close()


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,match", [
    (dict(json_schema='{"type": "object",'), "json_schema is not valid JSON"),
    (dict(json_schema=[1, 2]), "json_schema must be a JSON dict"),
    (dict(regex="a+", choice=["a"]), "at most one guide"), (dict(json_object=True, ebnf='root ::= "a"'), "at most one"),
    (dict(json_object=True, ignore_eos=True), "ignore_eos"), (dict(choice=[]), "choice"),
    (dict(choice=["a", ""]), "choice"), (dict(regex=""), "regex"), (dict(json_object="yes"), "json_object"),
    (dict(regex="a", any_whitespace=1), "any_whitespace"),
])
def test_bad_guides_raise_at_sampling_params(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_guides_need_a_tokenizer_and_guided_engines():
    eng = LLMEngine(model="dummy:tiny", max_num_seqs=2, **CPU)
    with pytest.raises(ValueError, match="tokenizer"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, json_object=True))
    assert eng.num_live_requests() == 0 and not eng.has_unfinished()
    eng = LLMEngine(model="dummy:tiny", max_num_seqs=2, guided=False, **CPU)
    with pytest.raises(ValueError, match="guided=False"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, regex="a"))
    assert eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].finish_reason == "length"


def test_a_compile_check_is_worked_out_once_a_guide(engine, monkeypatch):
    """check_compiled, the server's admission check (on a compile-check thread): a guide's first request walks its
    grammar's first mask and closing, later requests of it get the remembered answer, and an unsatisfiable guide is
    refused every time."""
    from engine.guided import tracker as tracker_module
    made, real = [], tracker_module.new_matcher
    monkeypatch.setattr(tracker_module, "new_matcher", lambda compiled: made.append(1) or real(compiled))
    tracker = engine.guided
    tracker.ensure_service()

    def check(schema):
        pending = tracker.admit(SamplingParams(json_schema=schema).guide, None)
        concurrent.futures.wait([pending.future], timeout=120)
        return tracker.check_compiled(pending)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    answers = [check(schema) for _ in range(3)]
    assert len(made) == 1 and answers[0] == answers[1] == answers[2] and answers[0] > 0
    for _ in range(2):
        with pytest.raises(ValueError):
            check({"type": "integer", "minimum": 5, "maximum": 1})


def _finals(engine, requests, hook=None):
    seqs = drive_hooked(engine, [(0, p, sp) for p, sp in requests], hook)
    assert_no_leak(engine)
    return seqs


def test_grammar_that_does_not_compile_fails_its_request_alone(engine, chat_prompts):
    bad = [("json_schema", SamplingParams(max_tokens=8, json_schema={"type": "string", "pattern": "(?<=a)b"})),
           ("json_schema", SamplingParams(max_tokens=8, json_schema={"$ref": "#/nope"})),
           ("regex", SamplingParams(max_tokens=8, regex="(ab")),
           ("ebnf", SamplingParams(max_tokens=8, ebnf="root ::= nope"))]
    good = [(chat_prompts[0], SamplingParams(max_tokens=8, temperature=0, choice=["Paris", "Rome"])),
            (chat_prompts[4], UNGUIDED)]
    seqs = _finals(engine, good + [(chat_prompts[i % 4], sp) for i, (_, sp) in enumerate(bad)])
    for (kind, _), seq in zip(bad, seqs[2:]):
        assert seq.finish_reason == "error" and seq.error.startswith(f"invalid {kind}:"), seq.error
        assert not seq.output_token_ids
    assert [s.output_token_ids for s in seqs[:2]] == [alone(engine, p, sp) for p, sp in good]


def test_grammar_that_allows_nothing_fails_without_nan(engine, chat_prompts, monkeypatch):
    apply = engine.runner.program.masker
    rows = []

    def checked(logits, bitmask):
        ok = apply(logits, bitmask)
        assert not logits.isnan().any() and logits.isfinite().any(dim=-1).all()
        rows.append(int((~ok).sum()))
        return ok

    monkeypatch.setattr(engine.runner.program, "masker", checked)
    empty, dead_end = r"root ::= [^\x00-\U0010FFFF]", r'root ::= "a" [^\x00-\U0010FFFF]'
    requests = [(chat_prompts[1], SamplingParams(max_tokens=8, temperature=0, ebnf=empty)),
                (chat_prompts[2], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ebnf=empty)),
                (chat_prompts[3], SamplingParams(max_tokens=8, temperature=0, ebnf=dead_end)),
                (chat_prompts[4], UNGUIDED)]
    seqs = _finals(engine, requests)
    for seq in seqs[:3]:
        assert seq.finish_reason == "error" and "no token was allowed" in seq.error, (seq.finish_reason, seq.error)
    assert [s.output_token_ids for s in seqs[:3]] == [[], [], engine.tokenizer.encode("a", add_special_tokens=False)]
    assert seqs[3].output_token_ids == alone(engine, *requests[3])
    assert sum(rows) >= 3


@pytest.mark.parametrize("depth", [1, 2])
def test_matcher_that_raises_in_the_callback_fails_its_request_alone(engine, chat_prompts, depth):
    victim = (chat_prompts[3], SamplingParams(max_tokens=24, temperature=0, json_schema=CAT))
    good = [(chat_prompts[0], SamplingParams(max_tokens=8, temperature=0, choice=["Paris", "Rome"])),
            (chat_prompts[4], UNGUIDED)]

    def arm(eng, ids):
        g = eng._seqs[ids[0]].guided if ids[0] in eng._seqs else None
        if g is not None and g.ready and not isinstance(g.matcher, Exploding):
            g.matcher = Exploding(g.matcher, 3)

    engine.set_depth(depth)
    try:
        seqs = _finals(engine, [victim] + good, arm)
    finally:
        engine.set_depth(2)
    assert seqs[0].finish_reason == "error" and "matcher exploded" in seqs[0].error, seqs[0].error
    assert seqs[0].output_token_ids == alone(engine, *victim)[:len(seqs[0].output_token_ids)]
    assert len(seqs[0].output_token_ids) in (3, 4)
    assert [s.output_token_ids for s in seqs[1:]] == [alone(engine, p, sp) for p, sp in good]


# ---- snapshots ---------------------------------------------------------------------------------------------
def test_empty_queue_reuses_the_last_snapshot_without_accepting_again(engine):
    """Warm-up and capture run the callback with nothing queued: masks refilled, no token accepted twice."""
    svc, vocab = service(engine), engine.runner.vocab
    masks = GrammarMasks(vocab, 4, torch.device("cpu"))
    g = GuidedRequest(SamplingParams(regex="a{2}").guide, None)
    g.matcher = xgr.GrammarMatcher(svc.compile_now(g.guide))
    [a] = engine.tokenizer.encode("a", add_special_tokens=False)
    snap = Snapshot(0, 1, (GuidedRow(2, g, 0, (a,), -1, -1),), np.array([0, 1]))
    masks.push(snap)
    assert not snap.done.is_set()
    masks.run()
    first = masks.host[0].clone()
    assert not masks.queue and masks.last is snap and snap.consumed and g.error is None
    assert snap.done.is_set(), "the loop thread's grammar_yield waits on it"
    assert (first[:2] == -1).all() and allowed(g.matcher, vocab) == {a}
    masks.host[0].zero_()
    masks.run()                                        # nothing queued: the same snapshot, masks only
    assert torch.equal(masks.host[0][:3], first[:3]) and g.error is None
    assert g.matcher.accept_token(a) and g.matcher.is_completed(), "the first run accepted 'a' once"


def test_finished_requests_leave_the_registry_without_a_collection(engine):
    """A step's snapshot holds its rows' requests: were it a reference cycle, every finished request's matcher and
    registry entry would live on until the garbage collector ran. With collection off, the registry holds as many
    entries after each round of requests."""
    import gc
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(max_tokens=12, temperature=0, json_schema=schema)
    registry, live = engine.runner.masks.registry, []
    gc.collect()
    gc.disable()
    try:
        for _ in range(4):
            outputs = engine.generate(["Write a JSON object."] * 3, params)
            assert all(o.text.startswith("{") for o in outputs)
            del outputs
            live.append(registry.live)
    finally:
        gc.enable()
    assert live[1:] == live[:1] * 3, live


# ---- compiling in the background --------------------------------------------------------------------
def test_request_prefills_while_its_grammar_compiles_and_samples_once_ready(engine, chat_prompts, monkeypatch):
    svc, gate = service(engine), threading.Event()
    submit = svc.pool.submit
    monkeypatch.setattr(svc.pool, "submit", lambda fn, *args, **kw: submit(lambda: gate.wait(60) and fn(), *args, **kw))
    schema = CAT | {"title": "not compiled before"}      # a cached grammar would never reach the pool
    prompt, params = chat_prompts[3], SamplingParams(max_tokens=24, temperature=0, json_schema=schema)
    other = engine.add_request(chat_prompts[4], UNGUIDED, retain=True)
    rid = engine.add_request(prompt, params, retain=True)
    seq = engine._seqs[rid]
    try:
        for _ in range(4):
            assert not [o for o in engine.step() if o.request_id == rid]
        assert not seq.guided.ready and not seq.output_token_ids and not seq.inflight_refs
        assert seq.num_computed_tokens == len(prompt) - 1, "all of the prompt but its sampling token"
        assert len(engine._seqs[other].output_token_ids) >= 2, "the others go on meanwhile"
    finally:
        gate.set()
    while engine.has_unfinished():
        engine.step()
    assert engine.take(rid).output_token_ids == alone(engine, prompt, params)
    assert engine.take(other).output_token_ids == alone(engine, chat_prompts[4], UNGUIDED)
    assert_no_leak(engine)


# ---- what each guide yields --------------------------------------------------------------------------
CITIES = ["Paris", "London", "Berlin", "Rome"]
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<cat>", "content": {
    "type": "json_schema", "json_schema": CAT}, "end": "</cat>"}}


def test_each_guide_kind_shapes_the_output_and_ends_it(engine, chat_prompts):
    nums = r"[1-9][0-9]*(, [1-9][0-9]*)*\."
    requests = [(chat_prompts[0], SamplingParams(max_tokens=16, temperature=0, choice=CITIES)),
                (chat_prompts[0], SamplingParams(max_tokens=16, temperature=1.0, seed=5, choice=CITIES)),
                (chat_prompts[3], SamplingParams(max_tokens=48, temperature=0, json_object=True)),
                (chat_prompts[3], SamplingParams(max_tokens=48, temperature=0.7, seed=2, json_object=True)),
                (chat_prompts[3], SamplingParams(max_tokens=5, temperature=0, json_object=True)),
                (chat_prompts[2], SamplingParams(max_tokens=32, temperature=0, regex=nums)),
                (chat_prompts[3], SamplingParams(max_tokens=48, temperature=0, structural_tag=TAG)),
                (chat_prompts[3], SamplingParams(max_tokens=5, temperature=0, json_object=True, close_at_budget=False))]
    seqs = _finals(engine, requests)
    eos = engine.eos_ids
    for seq in seqs[:2]:
        assert seq.finish_reason == "stop" and seq.text in CITIES, (seq.finish_reason, seq.text)
    for seq in seqs[2:4]:
        assert seq.finish_reason == "stop" and isinstance(json.loads(seq.text), dict), (seq.finish_reason, seq.text)
    closed, cut = seqs[4], seqs[7]          # five tokens: closed before the budget, or cut by it
    assert closed.finish_reason == "stop" and closed.closed_by == "budget" and len(closed.output_token_ids) <= 5
    assert isinstance(json.loads(closed.text), dict), closed.text
    assert cut.finish_reason == "length" and len(cut.output_token_ids) == 5 and cut.text.startswith("{")
    assert cut.closed_by is None
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    assert seqs[5].finish_reason == "stop" and re.fullmatch(nums, seqs[5].text), seqs[5].text
    tagged = re.fullmatch(r"<cat>(.*)</cat>", seqs[6].text, re.S)
    assert seqs[6].finish_reason == "stop" and tagged and set(json.loads(tagged[1])) == {"name", "age"}, seqs[6].text
    for seq in seqs:
        assert (seq.output_token_ids[-1] in eos) == (seq.finish_reason == "stop"), "a grammar ends at EOS"
