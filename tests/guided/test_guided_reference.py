"""Guided greedy decoding equals transformers' generate with xgrammar's logits processor on the same float32
weights, token for token (EOS included), alone and batched with unguided requests; every output that ends
"stop" is valid against its JSON schema (JSONSchemaBench's JME and BFCL sets, skipped when absent); and the
pipelined loop's snapshots feed each matcher exactly the committed tokens, giving the tokens of the blocking
loop, of the graphs' padded layout and of a preempting KV pool."""
import json
import os
import re
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from conftest import assert_no_leak
from engine.guided.compiler import compile_guide
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CPU, EagerGraphs, allowed, drive_hooked, staggered, stepped_output

DATA = Path(os.environ.get("SPECDEC_DATA", Path(__file__).resolve().parents[2] / "../shared/data"))
BENCH = DATA / "jsonschemabench" / "maskbench"
if not BENCH.is_dir():                       # a bare clone: the schemas these tests use, kept here
    BENCH = Path(__file__).resolve().parents[1] / "data" / "maskbench"
needs_data = pytest.mark.skipif(not BENCH.is_dir(), reason=f"no JSONSchemaBench schemas under {BENCH}")
JME = ["JME_45", "JME_38", "JME_7", "JME_17", "JME_91"]           # small schemas: short prompts
NEW = 32
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
REASON = 'root ::= ("yes" | "no") ", because " [a-z ]+ "."'


def schema(name):
    return json.loads((BENCH / f"{name}.json").read_text())["schema"]


def ask(engine, text):
    return engine.apply_chat_template([{"role": "user", "content": text}])


def schema_prompt(engine, s):
    return ask(engine, "Produce a JSON object that matches this schema: " + json.dumps(s))


def compiler(engine):
    if engine.guided.service is None:                  # built on the first guided request
        engine.guided.service = engine.guided._make()
    return engine.guided.service.compiler


def hf_guided(engine, hf_model, prompt, params):
    """transformers greedy generate, masked by xgrammar's own HF logits processor over the engine's grammar
    (same compiler, so the same tokenizer info); it stops at the engine's EOS ids and keeps the EOS token."""
    from xgrammar.contrib.hf import LogitsProcessor
    ids = torch.tensor([prompt])
    processor = LogitsProcessor(compile_guide(compiler(engine), params.guide))
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=params.max_tokens,
                            eos_token_id=sorted(engine.eos_ids), pad_token_id=0, logits_processor=[processor])
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def cases(engine):
    """name -> (prompt, params): five JME schemas, a regex, an EBNF grammar, a choice."""
    greedy = dict(max_tokens=NEW, temperature=0, close_at_budget=False, repetition_guard=False)   # as transformers
    out = {}
    if BENCH.is_dir():
        out = {n: (schema_prompt(engine, schema(n)), SamplingParams(json_schema=schema(n), **greedy)) for n in JME}
    out["regex"] = (ask(engine, "Give me a US phone number."), SamplingParams(regex=PHONE, **greedy))
    out["ebnf"] = (ask(engine, "Is the sky blue? Answer and give a reason."), SamplingParams(ebnf=REASON, **greedy))
    out["choice"] = (ask(engine, "Which planet is the largest?"),
                     SamplingParams(choice=["Mercury", "Venus", "Earth", "Mars", "Jupiter"], **greedy))
    return out


@pytest.fixture(scope="module")
def expected(engine, hf_model, cases):
    with torch.no_grad():
        return {name: hf_guided(engine, hf_model, *case) for name, case in cases.items()}


@pytest.mark.canary
def test_reference_outputs_are_guided(cases, expected, engine):
    """The references themselves follow their grammars (else equality would prove little). Upstream behaviour
    relied on: xgrammar's HF LogitsProcessor (xgrammar.contrib.hf) masks transformers' greedy generate so that
    the output follows the compiled grammar, and most of these references end at the tokenizer's EOS."""
    text = {n: engine.tokenizer.decode(t, skip_special_tokens=True) for n, t in expected.items()}
    assert re.fullmatch(PHONE, text["regex"]) and re.fullmatch(r"(yes|no), because [a-z ]+\.", text["ebnf"]), text
    assert text["choice"] in cases["choice"][1].choice, text
    ended = [n for n, t in expected.items() if t[-1] in engine.eos_ids]
    # 8 references: 5 JME schemas + regex, EBNF, choice
    assert len(ended) >= min(4, len(expected)), f"most references should end at EOS: {ended}"


@pytest.mark.parametrize("name", ["regex", "ebnf", "choice", pytest.param("JME_45", marks=needs_data)])
def test_single_guided_request_equals_transformers(engine, cases, expected, name):
    [seq] = engine.generate([cases[name][0]], cases[name][1])
    assert seq.output_token_ids == expected[name]
    assert seq.finish_reason == ("stop" if expected[name][-1] in engine.eos_ids else "length")
    assert_no_leak(engine)


@needs_data
def test_batched_guided_requests_equal_transformers_and_unguided_rows_are_untouched(engine, chat_prompts, cases,
                                                                                    expected):
    names = JME + ["regex", "ebnf"]
    unguided = (chat_prompts[0], SamplingParams(max_tokens=NEW, temperature=0))
    [free_alone] = engine.generate([unguided[0]], unguided[1])
    prompts, params = zip(*([cases[n] for n in names[:4]] + [unguided] + [cases[n] for n in names[4:]]))
    seqs = engine.generate(list(prompts), list(params))
    assert seqs.pop(4).output_token_ids == free_alone.output_token_ids
    assert {n: s.output_token_ids for n, s in zip(names, seqs)} == {n: expected[n] for n in names}
    assert_no_leak(engine)


@needs_data
@pytest.mark.slow
def test_every_stopped_output_is_valid_for_its_schema(engine):
    """Four JME and four BFCL schemas, one batch: each output that ends "stop" parses and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    names = ["JME_0", "JME_21", "JME_52", "JME_89", "BFCL_simple_1", "BFCL_simple_68", "BFCL_simple_242",
             "BFCL_multiple_73"]
    schemas = [schema(n) for n in names]
    seqs = engine.generate([schema_prompt(engine, s) for s in schemas],
                           [SamplingParams(max_tokens=96, temperature=0, json_schema=s) for s in schemas])
    stopped = 0
    for name, s, seq in zip(names, schemas, seqs):
        assert seq.finish_reason in ("stop", "length") and seq.error is None, (name, seq.error)
        if seq.finish_reason == "stop":
            jsonschema.validate(json.loads(seq.text), s)
            stopped += 1
    assert stopped >= 4, [(n, s.finish_reason, s.text) for n, s in zip(names, seqs)]
    assert_no_leak(engine)


# ---- snapshots: depth 2, graph layout, preemption ---------------------------------------------------
def _empty_queue(engine, ids):
    assert not engine.runner.masks.queue, "the CPU runs each step's callback inline: nothing stays queued"


@pytest.fixture(scope="module")
def pipelined(engine, chat_prompts):
    assert engine.config.depth == 2
    seqs = drive_hooked(engine, staggered(chat_prompts), _empty_queue)
    assert_no_leak(engine)
    return seqs


def test_pipelined_matchers_accepted_exactly_the_committed_tokens(engine, pipelined):
    """With step t+1 launched before step t commits, each snapshot feeds a matcher the tokens the host knows
    plus the one still on the device; every token exactly once, in order (a zombie row feeds the last)."""
    reasons = [s.finish_reason for s in pipelined]
    assert reasons.count("stop") >= 3 and reasons.count("length") >= 2, reasons
    fed_all = 0
    for seq in pipelined:
        g, out = seq.guided, stepped_output(seq)
        if g is None:
            continue
        assert seq.error is None and len(out) - 1 <= g.accepted <= len(out), (g.accepted, len(out))
        fresh = xgr.GrammarMatcher(g.future.result())
        for token in out[:g.accepted]:
            assert fresh.is_terminated() or fresh.accept_token(token)
        assert (fresh.is_terminated(), fresh.is_completed()) == (g.matcher.is_terminated(), g.matcher.is_completed())
        if not fresh.is_terminated():
            assert allowed(fresh, engine.runner.vocab) == allowed(g.matcher, engine.runner.vocab)
        fed_all += g.accepted == len(out) and g.matcher.is_terminated()
    assert fed_all >= 1, "a stopped request's zombie row should have fed its EOS"
    assert not engine.runner.masks.queue and engine.runner.masks.last.consumed


def test_blocking_loop_gives_the_pipelined_tokens(engine, chat_prompts, pipelined):
    engine.set_depth(1)
    try:
        seqs = drive_hooked(engine, staggered(chat_prompts), _empty_queue)
    finally:
        engine.set_depth(2)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in pipelined]
    assert [s.finish_reason for s in seqs] == [s.finish_reason for s in pipelined]
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def small():
    """Four rows, a 64-token step budget and a KV pool of 8 pages: the staggered workload must preempt."""
    return LLMEngine(max_num_seqs=4, num_kv_blocks=8, max_num_batched_tokens=64, **CPU)


def test_preemption_feeds_no_token_twice(small, chat_prompts, pipelined):
    """Recompute after preemption replays a request's tokens through the model, never through its matcher
    (a matcher fed twice rejects the token, or lets other tokens through)."""
    before = small.scheduler.num_preemptions
    seqs = drive_hooked(small, staggered(chat_prompts))
    assert small.scheduler.num_preemptions > before
    assert [s.error for s in seqs] == [None] * len(seqs)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in pipelined]
    assert_no_leak(small)


def test_graph_padded_layout_gives_the_eager_tokens(small, chat_prompts, pipelined):
    """Every step padded to its graph's shape, guided variants included: padding rows read stale mask rows and
    sample garbage, and no real row may notice (preemption included)."""
    small.runner.graphs = graphs = EagerGraphs(small.runner, guided=True)
    try:
        seqs = drive_hooked(small, staggered(chat_prompts))
    finally:
        small.runner.graphs = None
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in pipelined]
    assert graphs.replays["guided"] > 0 and graphs.replays["decode"] > 0 and graphs.replays["mixed"] > 0
    assert_no_leak(small)
