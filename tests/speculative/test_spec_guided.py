"""Guided + speculative decoding: greedy output equals guided output without speculation, token for token,
for every drafter (n-gram cut by the grammar, the EAGLE head and a draft model drafting under draft masks and
grammar-forced tokens), K 1 and 3, depth 1 and 2, batched with unguided and sampled rows; every output that
ends "stop" validates; failures in the draft callbacks end their request alone.
"""
import dataclasses
import itertools
import json

import jsonschema
import pytest

from conftest import assert_no_leak
from engine.guided.draft_masks import DraftMasks
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import ASK, PEOPLE, WEATHER, EagerGraphs, allowed, drive, stepped_output

CPU = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, spec_min_acceptance=0.0)


def run(workload, depth=2, graph_layout=False, **cfg):
    eng = LLMEngine(**(CPU | dict(depth=depth) | cfg))
    if graph_layout:
        eng.runner.graphs = EagerGraphs(eng.runner, guided=True)
    seqs = drive(eng, workload)
    assert_no_leak(eng)
    if eng.scheduler.spec:
        assert len(eng.scheduler.row_pools[0]) == eng.runner.pool.num_rows, "token-pool rows leaked"
    return eng, seqs


def check_valid(workload, seqs):
    for (_, _, params), seq in zip(workload, seqs):
        assert seq.error is None, seq.error
        if params.guide is not None and params.guide.kind == "json_schema" and seq.finish_reason == "stop":
            jsonschema.validate(json.loads(seq.text), json.loads(params.guide.source))


@pytest.fixture(scope="module")
def reference(guided_workload):
    eng, seqs = run(guided_workload, depth=1)
    check_valid(guided_workload, seqs)
    assert sum(s.finish_reason == "stop" for s in seqs) >= 3
    return seqs


def same_greedy(workload, got, ref):
    for (_, _, params), a, b in zip(workload, got, ref):
        if params.temperature == 0:
            assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason), a.text


# the head with the defaults (drafts cut by the grammar's walk); the draft model is the target itself, drafting
# under draft masks: nearly every draft passes (forced drafts off: a forced text's canonical tokens need not be
# the target's own choice)
DRAFTERS = {"ngram": dict(speculative="ngram"), "eagle": dict(speculative="eagle"),
            "draft_model": dict(speculative="draft_model", spec_draft_model="default", guided_draft_masks=True,
                                guided_forced_drafts=False)}


# every pair of (drafter, K, depth) values once: 6 cases, not the 12 of every triple
@pytest.mark.parametrize("drafter,k,depth", [("ngram", 1, 1), ("ngram", 3, 2), ("eagle", 1, 2), ("eagle", 3, 1),
                                             ("draft_model", 1, 1), ("draft_model", 3, 2)])
def test_guided_speculation_equals_guided(guided_workload, reference, drafter, k, depth):
    eng, got = run(guided_workload, depth, num_speculative_tokens=k, **DRAFTERS[drafter])
    same_greedy(guided_workload, got, reference)
    check_valid(guided_workload, got)
    t = eng.timings
    assert t.spec_rows > 0 and t.spec_accepted > 0, "nothing was speculated or accepted"
    guided = [s for s, w in zip(got, guided_workload) if w[2].guide is not None and s.spec is not None]
    # these guided outputs have budgets of 16-48 tokens and spend most of them in their closing zone, where a row
    # verifies no draft: n-gram drafts find too few matches before it (test_ngram_drafts_the_grammar_rejects_are_cut
    # covers them); the head's and the draft model's pass
    assert drafter == "ngram" or sum(s.spec.accepted for s in guided) > 0, "no guided row accepted a draft"
    if drafter == "draft_model":            # the target drafting for itself under the same masks
        assert t.acceptance_length > k + 0.5


def test_any_k_step_by_step_changes_no_guided_token(guided_workload, reference):
    """The draft budget's K changes from step to step (every level and none, in turn): the grammar walks each
    step's drafts at that width, in the graphs' padded layouts."""
    eng = LLMEngine(**(CPU | dict(depth=2, speculative="eagle", num_speculative_tokens=3)))
    eng.runner.graphs = EagerGraphs(eng.runner, guided=True)
    budget = eng.scheduler.spec.budget
    budget.set_costs({(k, r): 1.0 for k in (0, 1, 3) for r in (1, 2, 4, 8)})
    picks = itertools.cycle((3, 1, 0, 3, 3, 1, 1, 0))
    budget.choose = lambda rows: next(picks)
    got = drive(eng, guided_workload)
    same_greedy(guided_workload, got, reference)
    check_valid(guided_workload, got)
    assert eng.timings.spec_accepted > 0 and eng.runner.graphs.replays["spec"] > 0
    assert_no_leak(eng)


@pytest.mark.parametrize("masks,forced", [(False, True), (True, False), (True, True)])
def test_draft_mask_and_forced_modes_change_no_token(guided_workload, reference, masks, forced):
    eng, got = run(guided_workload, graph_layout=True, speculative="eagle", guided_draft_masks=masks,
                   guided_forced_drafts=forced)
    same_greedy(guided_workload, got, reference)
    check_valid(guided_workload, got)
    draft = eng.runner.program.draft_masks
    assert (draft is None) == (not masks and not forced)
    if forced:
        assert draft.forced_drafts > 0
    assert eng.runner.graphs.replays["spec"] > 0 and eng.runner.graphs.replays["guided"] > 0


def test_ngram_drafts_the_grammar_rejects_are_cut(guided_workload, reference):
    """N-gram drafts are not picked under a mask: the step's mask callback walks them, and verification takes
    at most the drafts the grammar accepts."""
    eng = LLMEngine(**CPU, speculative="ngram")
    program, seen = eng.runner.program, []
    verify = program.verify

    def probe(slot, ids, logits, S, K, greedy, grammar, drafted, *extras):
        out = verify(slot, ids, logits, S, K, greedy, grammar, drafted, *extras)
        if K and grammar is not None:
            seen.append((drafted.tolist(), grammar[1].tolist(), out[1].tolist()))
        return out
    program.verify = probe
    got = drive(eng, guided_workload)
    same_greedy(guided_workload, got, reference)
    pairs = [(d, c, a) for step in seen for d, c, a in zip(*step)]
    assert all(a <= c for _, c, a in pairs), "verification took a draft the grammar rejected"
    assert any(c < d for d, c, _ in pairs), "no n-gram draft was cut by the grammar"
    assert any(a > 0 for _, _, a in pairs)


class _Raising:
    """A matcher that raises once it has been asked for its jump-forward text `n` times (draft phase only)."""
    def __init__(self, matcher, n):
        self._m, self._n = matcher, n

    def find_jump_forward_string(self):
        self._n -= 1
        if self._n < 0:
            raise RuntimeError("matcher broke while drafting")
        return self._m.find_jump_forward_string()

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_draft_callback_failure_fails_its_request_alone(guided_workload, reference, monkeypatch):
    """The Python draft callbacks (grammar_node="python"): a matcher that raises while drafting fails its
    request alone."""
    step = DraftMasks._step
    armed = {}

    def arm(self, snap, j):
        for r in snap.rows:
            g = r.request
            if g.guide.source == json.dumps(PEOPLE) and id(g) not in armed:
                armed[id(g)] = g.matcher = _Raising(g.matcher, 3)
        return step(self, snap, j)
    monkeypatch.setattr(DraftMasks, "_step", arm)
    eng, got = run(guided_workload, speculative="eagle", guided_forced_drafts=True, grammar_node="python")
    assert armed, "the people request never drafted"
    assert got[1].finish_reason == "error" and "matcher broke while drafting" in got[1].error
    rest = [i for i in range(len(got)) if i != 1]
    same_greedy([guided_workload[i] for i in rest], [got[i] for i in rest], [reference[i] for i in rest])


def test_draft_mask_that_allows_nothing_stops_drafting_without_nan(guided_workload, reference, monkeypatch):
    """An all-zero draft mask (as a grammar with no continuation would give): the row drafts nothing there
    (its argmax is not taken), the output is unchanged. (Draft callback j runs inline on the CPU: the native
    node's output is overwritten after it, as the Python path's would be.)"""
    run_draft = DraftMasks.run

    def empty(self, j):
        run_draft(self, j)
        snap = self.masks.last
        for r in snap.rows:
            if r.request.guide.source == json.dumps(PEOPLE):
                self.mask_np[j][r.row] = 0
                self.ctl_np[j][r.row] = -1
    monkeypatch.setattr(DraftMasks, "run", empty)
    eng, got = run(guided_workload, speculative="eagle", guided_draft_masks=True)
    same_greedy(guided_workload, got, reference)
    assert got[1].spec.proposed == 0, "a row whose draft mask allows nothing must not draft"


# ---- GPU: graphs on, the pipelined loop, the callbacks on the driver thread --------------------------
GPU_GRAPHS = dict(device="cuda", dtype="float32", attention_backend="triton", max_model_len=1024, max_num_seqs=8,
                  spec_min_acceptance=0.0)


def matchers_fed_exactly_the_committed_tokens(seqs, vocab):
    """Each matcher's state is a fresh matcher's fed the committed tokens it accepted (every draft walk of
    every replay rolled back); a request's last step's tokens may not have been accepted (no step after it), nor
    a closing the host committed whole (no step ran it)."""
    import xgrammar as xgr
    for seq in seqs:
        g, out = seq.guided, stepped_output(seq)
        if g is None or seq.finish_reason == "error":
            continue
        fresh = xgr.GrammarMatcher(g.future.result())
        n = min(g.accepted, len(out))
        assert n >= len(out) - 4, (n, len(out))       # the last step's 1 + K tokens at most
        for token in out[:n]:
            assert fresh.is_terminated() or fresh.accept_token(token)
        if g.accepted <= len(out):
            assert fresh.is_terminated() == g.matcher.is_terminated()
            if not fresh.is_terminated():
                assert allowed(fresh, vocab) == allowed(g.matcher, vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter,k,masks", [("ngram", 3, False), ("eagle", 1, False), ("eagle", 3, False),
                                             ("eagle", 3, True), ("draft_model", 3, True)])
def test_gpu_graphs_guided_speculation_equals_guided(guided_workload, drafter, k, masks):
    """masks: draft masks and forced drafts on (K + 1 grammar callbacks in each drafting step's graph)."""
    _, ref = run(guided_workload, **GPU_GRAPHS)
    eng, got = run(guided_workload, **(DRAFTERS[drafter] | GPU_GRAPHS | dict(
        num_speculative_tokens=k, debug_sync=True, guided_draft_masks=masks,
        guided_forced_drafts=masks and drafter == "eagle")))
    same_greedy(guided_workload, got, ref)
    check_valid(guided_workload, got)
    assert eng.runner.graphs.replays["spec"] > 0 and eng.runner.graphs.replays["guided"] > 0
    assert eng.timings.spec_accepted > 0
    matchers_fed_exactly_the_committed_tokens(got, eng.runner.vocab)
    assert not eng.runner.masks.queue


@pytest.mark.gpu
def test_gpu_32_guided_speculative_rows_finish_without_deadlock(engine):
    """32 guided rows speculating with draft masks and forced drafts (4 host callbacks per step), graphs on,
    pipelined, bf16, replayed for hundreds of steps: every request finishes (no deadlock) and validates."""
    import threading
    prompts = [engine.apply_chat_template([{"role": "user", "content": ASK[i % 2] + f" Case {i}."}]) for i in range(32)]
    params = [SamplingParams(max_tokens=160, temperature=0, json_schema=WEATHER if i % 2 == 0 else PEOPLE)
              for i in range(32)]
    eng = LLMEngine(device="cuda", speculative="eagle", max_num_seqs=32, max_model_len=1024, guided_draft_masks=True,
                    guided_forced_drafts=True)
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("seqs", eng.generate(prompts, params)), daemon=True)
    worker.start()
    worker.join(timeout=180)
    assert not worker.is_alive(), "32 guided speculative rows did not finish within 180 s"
    seqs = done["seqs"]
    check_valid([(0, p, sp) for p, sp in zip(prompts, params)], seqs)
    assert eng.runner.graphs.replays["spec"] > 25 and eng.timings.spec_accepted > 0
    matchers_fed_exactly_the_committed_tokens(seqs, eng.runner.vocab)
    assert_no_leak(eng)


def test_eos_inside_accepted_drafts_ends_the_request(guided_workload):
    """The target drafting for itself under draft masks drafts the grammar's EOS and the target accepts it: the
    request ends at the EOS, tokens after it in the same step are dropped, the output equals the reference."""
    workload = [(0, prompt, dataclasses.replace(params, close_at_budget=False))     # its own EOS, not a closing's
                for _, prompt, params in guided_workload[:1]]
    reference = run(workload, depth=1)[1]
    eng = LLMEngine(**CPU, **DRAFTERS["draft_model"])
    commit, cuts = eng.output.commit, []

    def probe(seq, tokens):
        before = len(seq.output_token_ids)
        reason = commit(seq, tokens)
        cuts.append((tokens, len(seq.output_token_ids) - before, reason))
        return reason
    eng.output.commit = probe
    got = drive(eng, workload)
    assert got[0].output_token_ids == reference[0].output_token_ids and got[0].finish_reason == "stop"
    eos = [(toks, n) for toks, n, reason in cuts if reason == "stop" and any(t in eng.eos_ids for t in toks)]
    assert eos and eos[-1][0].index(next(t for t in eos[-1][0] if t in eng.eos_ids)) > 0, \
        "EOS was not accepted inside a run of drafts"
