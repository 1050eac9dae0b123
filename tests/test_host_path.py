"""The host path's native walks (engine/requests/csrc/hostpath.cpp: scheduling runs of decode rows, a launched
step's counters, the commit of tokens that end nothing) against their Python definitions, over a few hundred
rows of a two-layer model with SmolLM2's vocabulary: the same outputs step by step, token for token.

The load mixes every way a request ends (EOS, stop token, stop string, max_tokens, abort, a guided grammar that
fails), sampled and seeded rows, logprobs, streamed text, JSON-schema rows with closing, prompts that share a
cached prefix, and a KV pool small enough to preempt.
"""
import os
import random

import pytest

from conftest import assert_no_leak
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CAT

TOKENIZER = os.environ.get("SPECDEC_MODEL") or "default"
ROWS = 256


def _engine(native: bool, **kw) -> LLMEngine:
    eng = LLMEngine(model="dummy:smollm2-tiny", tokenizer=TOKENIZER, device="cpu", dtype="float32",
                    attention_backend="torch", max_num_seqs=ROWS, max_num_batched_tokens=2048, max_model_len=256,
                    num_kv_blocks=400, seed=0, **kw)
    eng.scheduler.native = eng.commits.native = native
    return eng


def _requests(eng, rng: random.Random, count: int) -> list[tuple[int, list[int], SamplingParams, bool]]:
    """(arrival step, prompt ids, params, stream) for `count` requests: a shared head (prefix-cache hits) and a tail of
    their own; the stop token and word are common ones of the model's free output."""
    head = eng.apply_chat_template([{"role": "user", "content": "Name a colour and describe it. " * 3}])
    free = eng.generate([head], SamplingParams(max_tokens=24, temperature=0))[0]
    stop_token, stop_word = free.output_token_ids[3], eng.tokenizer.decode(free.output_token_ids[4:6]).strip()
    eos = sorted(eng.eos_ids)[0]
    out = []
    for i in range(count):
        kind = i % 10
        kw = dict(max_tokens=rng.randrange(2, 40), temperature=0.0)
        arrival = rng.randrange(0, 30)
        if kind in (1, 4):      # short and early: a sampled or logprobs row makes the whole step's sampling slow here
            kw, arrival = dict(max_tokens=rng.randrange(2, 6), temperature=0.0), 0
        if kind == 1:
            kw.update(temperature=0.8, top_p=0.9, seed=i)
        elif kind == 2:
            kw.update(stop_token_ids=[stop_token, eos])
        elif kind == 3:
            kw.update(stop=[stop_word] if stop_word else [])
        elif kind == 4:
            kw.update(logprobs=2)
        elif kind == 5:
            kw = dict(max_tokens=rng.randrange(12, 30), temperature=0.0, json_schema=CAT)
        elif kind == 6:
            kw.update(ignore_eos=True, max_tokens=60)
        prompt = head + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 40))]
        out.append((arrival, prompt, SamplingParams(**kw), kind == 7))
    return out


def _run(native: bool, count: int = 320, **kw) -> tuple[list, list, dict]:
    """Each step's outputs, each request's end, and what the load did (preemptions, prefix-cache hit tokens)."""
    eng = _engine(native, **kw)
    work = sorted(enumerate(_requests(eng, random.Random(7), count)), key=lambda w: w[1][0])
    ids, steps, step = {}, [], 0
    while (work or eng.has_unfinished()) and step < 1000:
        while work and work[0][1][0] <= step:
            i, (_, prompt, params, stream) = work.pop(0)
            ids[i] = eng.add_request(prompt, params, retain=True, stream=stream)
        if step == 12:                                      # aborts while their rows are in flight
            for rid in sorted(eng._seqs)[5:8]:
                eng.abort(rid)
        if step == 15:                                      # a guided request's grammar fails (its callback's mark)
            failing = next(s for s in eng._seqs.values() if s.guided is not None and s.output_token_ids)
            failing.guided.error = "the grammar rejected a token"
        for seq in list(eng._seqs.values()):     # every compile lands before the step: the same step in both runs
            if seq.guided is not None and not seq.guided.future.done():
                seq.guided.future.result(timeout=120)
        outs = eng.step()
        steps.append([(o.request_id, o.new_token_ids, o.new_text, o.finished, o.finish_reason, o.error,
                       o.logprobs) for o in outs])
        step += 1
    assert_no_leak(eng)
    seqs = [eng.take(ids[i]) for i in sorted(ids)]
    return steps, [(s.output_token_ids, s.finish_reason, s.text, s.error, s.first_token_time is not None)
                   for s in seqs], dict(preemptions=eng.scheduler.num_preemptions, hits=eng.blocks.hit_tokens)


@pytest.mark.timeout(600)
def test_the_native_host_path_commits_what_the_python_one_does():
    native_steps, native_seqs, _ = _run(native=True)
    python_steps, python_seqs, load = _run(native=False)
    assert load["preemptions"] > 0 and load["hits"] > 0         # the load preempts and hits the cache
    reasons = {s[1] for s in python_seqs}
    assert {"stop", "length", "abort", "error"} <= reasons, reasons
    assert max(len(s) for s in python_steps) >= ROWS // 2         # a few hundred rows at once
    assert len(native_steps) == len(python_steps)
    for step, (got, want) in enumerate(zip(native_steps, python_steps)):
        assert got == want, step
    assert native_seqs == python_seqs
    failed = [s for s in python_seqs if s[1] == "error"]
    assert len(failed) == 1 and failed[0][3] == "the grammar rejected a token"      # the bad request fails alone


@pytest.mark.timeout(600)
def test_a_speculating_engine_launches_and_commits_as_the_python_walks_do():
    """With n-gram drafts the launched counters are native (pending counts 1 + K a speculating row), and so are the
    scheduling and commits of plain steps (those of more rows than speculate): the outputs equal those of the
    all-Python walks."""
    native = _run(native=True, count=64, speculative="ngram")
    python = _run(native=False, count=64, speculative="ngram")
    assert native == python


@pytest.mark.timeout(600)
def test_the_native_guided_walk_reads_what_the_python_one_does(monkeypatch):
    """Every step's guided-row snapshot is built from the native walk's columns; at each step they equal
    guided_columns' on the same rows (JSON-schema rows among the others, preemptions and prefix-cache hits)."""
    import engine.llm_engine as llm_engine
    from engine.guided import snapshot
    from engine.requests import _hostpath
    compared = []

    def both(slot_index, rows, step=0, width=1, walk=snapshot.guided_columns):
        assert walk is _hostpath.guided_columns
        got, want = walk(rows), snapshot.guided_columns(rows)
        assert got == want and all(type(a) is list for a in got), step
        compared.append((len(want[1]), len(want[4]), sum(src >= 0 for src in want[5]), len(want[6])))
        return snapshot.build_snapshot(slot_index, rows, step, width, walk)

    monkeypatch.setattr(llm_engine, "build_snapshot", both)
    _run(native=True, count=160)
    guided, fed, in_flight, unguided = (max(c[j] for c in compared) for j in range(4))
    assert len(compared) > 20 and guided >= 8 and unguided >= 8      # many steps, both kinds of rows at once
    assert fed > 0 and in_flight > 0        # rows with host-known tokens to feed, and with a token in flight


def test_the_native_registry_entries_are_the_requests_own():
    """Snapshot.bind names each guided row by native.registry_entries: each request's GuidedRequest.entry, cached
    for its own registry, registered on first use; and the native walks read a request's counters as its
    properties give them (the native RowState: `accepted`, and no error until one is set)."""
    from engine.guided import native
    from engine.requests import _hostpath
    from engine.scheduler import ScheduledRow
    eng = _engine(native=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ids = [eng.add_request(eng.tokenizer.encode(f"Reply {i}."), SamplingParams(max_tokens=16, json_schema=schema))
           for i in range(3)]
    for _ in range(4):
        eng.step()
    requests = [eng._seqs[i].guided for i in ids]
    registry = eng.runner.masks.registry
    assert native.registry_entries(registry, requests) == [g.entry(registry) for g in requests]
    other = native.Registry(eng.runner.masks.matchers)          # not yet registered there: entry() registers
    got = native.registry_entries(other, requests[:2])
    assert got == [g.entry(other) for g in requests[:2]] and got != native.registry_entries(registry, requests[:2])
    rows = [ScheduledRow(eng._seqs[i], 0, 1, True, j, 0, 0, 0) for j, i in enumerate(ids)]
    columns = _hostpath.guided_columns(rows)
    assert columns[2] == [g.accepted for g in requests] and all(n > 0 for n in columns[2])
    requests[0].error = "set by a test"         # as a grammar callback sets it: the row's commit fails it alone
    outs = [o for _ in range(3) for o in eng.step()]
    failed = [o for o in outs if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == [ids[0]] and "set by a test" in failed[0].error
    eng.close()
