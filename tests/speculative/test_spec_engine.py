"""Speculative decoding in the engine: greedy output with speculation equals output without, token for token.

The workload is test_pipeline's (EOS, stop string, stop token, max_tokens, late arrivals, preemption) minus
its sampled request, plus two prompts whose answers repeat themselves, so n-gram drafts get accepted and
stops land inside accepted runs. Every run checks that KV pages and speculation rows all come back.
"""
import itertools

import pytest

from conftest import assert_no_leak
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CPU, PREEMPTING, REPEATING, ROOMY, EagerGraphs, drive, record_drafts, record_steps

# float32: in bfloat16 scoring 1 + K tokens at once rounds differently from scoring one, and a near-tie argmax
# can flip (bench/spec/spec.py reports how often outputs stay identical in bfloat16: same_tokens_as_none)
GPU_GRAPHS = dict(device="cuda", dtype="float32", attention_backend="triton", max_model_len=1024, max_num_seqs=8)


@pytest.fixture(scope="module")
def spec_workload(engine, workload):
    greedy = [w for w in workload if w[2].temperature == 0]
    prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in REPEATING]
    ref = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stop_tok = ref[0].output_token_ids[10]                  # "3" of "3. 3", inside a repeating answer
    return greedy + [(1, prompts[0], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_tok])),
                     (2, prompts[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))]


def run(workload, depth, graph_layout=False, cuts=None, **cfg):
    eng = LLMEngine(**(CPU | dict(depth=depth) | cfg))
    if graph_layout:
        eng.runner.graphs = EagerGraphs(eng.runner)
    if cuts is not None:                 # (tokens offered, tokens appended) of every multi-token commit
        commit = eng.output.commit

        def probe(seq, tokens):
            before = len(seq.output_token_ids)
            reason = commit(seq, tokens)
            if len(tokens) > 1:
                cuts.append((len(tokens), len(seq.output_token_ids) - before, reason))
            return reason
        eng.output.commit = probe
    seqs = drive(eng, workload)
    assert_no_leak(eng)
    if eng.scheduler.spec:
        assert len(eng.scheduler.row_pools[0]) == eng.runner.pool.num_rows, "token-pool rows leaked"
    return eng, seqs


@pytest.fixture(scope="module")
def reference(spec_workload):
    return {name: run(spec_workload, 1, **cfg)[1] for name, cfg in (("roomy", ROOMY), ("preempting", PREEMPTING))}


def _same(got, ref):
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in ref]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in ref]
    assert [s.text for s in got] == [s.text for s in ref]


# (K, depth, pool) of n-gram; K = 3 pipelined and roomy is EAGLE's and the draft model's main case
CASES = [(1, 2, "roomy"), (3, 1, "roomy"), (5, 2, "roomy"), (3, 1, "preempting"), (3, 2, "preempting")]


# draft_model drafts with the default model itself (so nearly every draft passes, and stops land inside long
# accepted runs) or with a random two-layer model (nearly none pass)
DRAFT_MODELS = {"draft_model": "default", "draft_model-random": "dummy:smollm2-tiny"}


def drafter_cfg(drafter: str) -> dict:
    if drafter in DRAFT_MODELS:
        return dict(speculative="draft_model", spec_draft_model=DRAFT_MODELS[drafter])
    return dict(speculative=drafter)


# n-gram takes every case; EAGLE the main one (K = 3, pipelined, roomy), K = 1 and the blocking loop preempting;
# the draft model (the default model itself: each draft a forward of the target's size) the main one, a random
# draft model preempting (its KV pages preempted with the target's). The default model drafting in the blocking loop:
# test_stops_inside_accepted_runs[1]
@pytest.mark.parametrize("drafter,k,depth,cfg", [("ngram", *c) for c in CASES] + [
    ("eagle", 3, 2, "roomy"), ("eagle", 1, 2, "roomy"), ("eagle", 3, 1, "preempting"),
    ("draft_model", 3, 2, "roomy"), ("draft_model-random", 3, 2, "preempting")])
def test_greedy_speculation_equals_plain(spec_workload, reference, drafter, k, depth, cfg):
    """Every drafter: n-gram, the EAGLE head shipped for the default model, and a draft model (the KV pages of
    a head or a draft model come and go with the target's: the leak check covers them)."""
    eng, got = run(spec_workload, depth, num_speculative_tokens=k, **drafter_cfg(drafter),
                   **(ROOMY if cfg == "roomy" else PREEMPTING))
    _same(got, reference[cfg])
    t = eng.timings
    assert t.spec_rows > 0, "nothing was speculated"
    if drafter == "draft_model-random":                 # random drafts: verification rejects (nearly) all
        return
    assert t.spec_accepted > 0 and 1.0 < t.acceptance_length <= k + 1
    if drafter == "draft_model" and cfg == "roomy":    # the target drafting for itself, in float32
        assert t.acceptance_length > k + 0.5
    if cfg == "preempting":
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("depth", [1, 2])
def test_stops_inside_accepted_runs(engine, depth):
    """A stop token, a stop string, EOS and max_tokens landing inside a run of accepted drafts: the output ends
    exactly where the plain engine's does (drafts after the stop are dropped)."""
    prompt = engine.apply_chat_template([{"role": "user", "content": REPEATING[1]}])
    ref = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert ref.finish_reason == "length" and '"Paris"' in ref.text
    cases = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ref.output_token_ids[14]]),
             SamplingParams(max_tokens=40, temperature=0, stop=["Paris"]),
             SamplingParams(max_tokens=17, temperature=0),
             SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)]
    workload = [(0, prompt, p) for p in cases]
    _, plain = run(workload, depth)
    cuts = []
    for drafter in ("ngram", "draft_model"):     # the draft model = the target: long accepted runs
        cuts.clear()
        eng, got = run(workload, depth, cuts=cuts, num_speculative_tokens=5, **drafter_cfg(drafter))
        _same(got, plain)
        assert any(appended < offered and reason == "stop" for offered, appended, reason in cuts), (drafter, cuts)
    assert [s.finish_reason for s in got] == ["stop", "stop", "length", "length"]
    assert eng.timings.acceptance_length > 3


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "draft_model"])
def test_graph_padded_spec_steps_change_no_token(spec_workload, reference, drafter):
    eng, got = run(spec_workload, 2, graph_layout=True, num_speculative_tokens=3, **drafter_cfg(drafter))
    _same(got, reference["roomy"])
    assert eng.runner.graphs.replays["spec"] > 0 and eng.runner.graphs.replays["mixed"] > 0


@pytest.mark.parametrize("drafter", ["ngram", "eagle", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_any_k_step_by_step_changes_no_token(spec_workload, reference, drafter):
    """Each step verifies the K the budget picks (here every level and none, in turn), in the graphs' padded
    layouts: greedy output equals the plain engine's, and nothing leaks. A head's or a draft model's step of
    level k drafts k (a plain step all 5), so the step after a lower level verifies at most that level's drafts."""
    eng = LLMEngine(**CPU, depth=2, num_speculative_tokens=5, **drafter_cfg(drafter))
    used, widths = [], []
    proposals = record_drafts(eng.runner.program.drafter)

    class Recording(EagerGraphs):
        def replay(self, slot, variant):
            used.append(slot.graph_key.spec_k)
            before = len(proposals)
            result = super().replay(slot, variant)
            if len(proposals) > before:
                widths.append((slot.graph_key.spec_k, proposals[-1].draft_tokens.shape[1]))
            return result
    eng.runner.graphs = Recording(eng.runner)
    budget = eng.scheduler.spec.budget
    assert budget.levels == (1, 3, 5)
    budget.set_costs({(k, r): 1.0 for k in (0, 1, 3, 5) for r in (1, 2, 4, 8)})
    picks = itertools.cycle((5, 1, 0, 3, 5, 3, 1, 0))
    budget.choose = lambda rows: next(picks)
    observed, observe = [], budget.observe
    budget.observe = lambda *args: observed.append(args) or observe(*args)
    seqs = drive(eng, spec_workload)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in reference["roomy"]]
    assert [s.finish_reason for s in seqs] == [s.finish_reason for s in reference["roomy"]]
    assert {1, 3, 5} <= set(used), used
    assert {(k, (k or 5) if drafter != "ngram" else 5) for k in (0, 1, 3, 5)} == set(widths), widths
    assert eng.timings.spec_accepted > 0
    levels = eng.timings.spec_levels        # verifying rows by the level their step verified
    assert set(levels) == {1, 3, 5} and sum(levels.values()) == eng.timings.spec_rows, levels
    # after a lower level a row holds fewer drafts than its step verifies through no fault of its drafts: only an
    # n-gram row, whose matches vary, counts a miss after its drafts (the budget gets a level)
    assert len(observed) == eng.timings.spec_rows
    assert all((args[4] is not None) == (drafter == "ngram") for args in observed), observed[:4]
    assert_no_leak(eng)
    assert len(eng.scheduler.row_pools[0]) == eng.runner.pool.num_rows


@pytest.mark.parametrize("layout,drafter", [("graphs", "ngram"), ("graphs", "eagle"), ("eager", "ngram")])
def test_quiet_steps_draft_nothing_and_change_no_token(spec_workload, reference, layout, drafter):
    """A paused engine's plain steps draft nothing, and the step after one drafts before any verifies: greedy output
    equals the plain engine's. graphs: the graphs' padded layouts, the budget's choices scripted; eager: no step
    costs, paused by spec_min_acceptance with a probe now and then. A head still reads a quiet step's tokens."""
    if layout == "graphs":
        eng = LLMEngine(**CPU, depth=2, speculative=drafter, num_speculative_tokens=3)
        eng.runner.graphs = EagerGraphs(eng.runner)
        budget = eng.scheduler.spec.budget
        budget.set_costs({(k, r): 1.0 for k in (0, 1, 3) for r in (1, 2, 4, 8)})
        picks = itertools.cycle((3, 0, 0, 0, 1, 0, 0, 3, 3, 0))
        budget.choose, budget.plain_next = (lambda rows: next(picks)), (lambda: True)
    else:
        eng = LLMEngine(**CPU, depth=2, speculative=drafter, num_speculative_tokens=3, spec_min_acceptance=50.0)
        eng.scheduler.spec.probe_every = 3
    log = record_steps(eng)
    _same(drive(eng, spec_workload), reference["roomy"])
    assert_no_leak(eng)
    assert any(q for _, q, _ in log) and any(k for k, _, _ in log), log
    assert not any(drafted for _, quiet, drafted in log if quiet), log
    assert eng.timings.quiet_steps == sum(quiet for _, quiet, _ in log)
    assert all(not log[i - 1][1] for i, (k, _, _) in enumerate(log) if k and i), log


def test_plain_steps_of_a_speculating_engine_commit_as_plain_ones(spec_workload, reference):
    """Steps of more rows than spec_max_batch do not speculate: their tokens come back one a row and commit on the
    plain path (native runs included), with stops, EOS and max_tokens where the plain engine has them."""
    eng, got = run(spec_workload, 2, speculative="ngram", num_speculative_tokens=3, spec_max_batch=1)
    _same(got, reference["roomy"])
    assert eng.timings.spec_rows > 0, "the steps of one row still speculate"


def test_statistics_and_per_request_k(engine, spec_workload):
    prompt = spec_workload[-1][1]
    eng = LLMEngine(**CPU, speculative="ngram", num_speculative_tokens=3)
    on = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    off = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, num_speculative_tokens=0)
    outs = {}
    for params in (on, off):
        eng.add_request(prompt, params)
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
    a, b = outs[0], outs[1]
    assert a.token_ids == b.token_ids
    assert a.spec["steps"] > 0 and a.spec["accepted"] > 0 and a.spec["acceptance_length"] > 1
    assert len(a.spec["rate_by_position"]) == 3 and all(0 <= r <= 1 for r in a.spec["rate_by_position"])
    assert b.spec is None or b.spec["accepted"] == 0
    with pytest.raises(ValueError, match="num_speculative_tokens=4"):
        eng.add_request(prompt, SamplingParams(num_speculative_tokens=4))
    with pytest.raises(ValueError, match="drafts at most 0"):
        engine.add_request(prompt, SamplingParams(num_speculative_tokens=2))
    assert_no_leak(eng)


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_seeded_sampling_is_reproducible_across_batches(spec_workload, drafter):
    """Rejection sampling draws from the request's seed alone: the same request alone or beside others
    (admitted in the same step, the acceptance pause off: every step speculates alike) gives the same tokens."""
    prompt, other = spec_workload[-1][1], spec_workload[-2][1]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    spec = dict(speculative=drafter, num_speculative_tokens=3, spec_min_acceptance=0.0)
    alone = LLMEngine(**CPU, **spec).generate([prompt], params)[0].output_token_ids
    eng = LLMEngine(**CPU, **spec)
    beside = eng.generate([other, prompt], [SamplingParams(max_tokens=24, temperature=0), params])[1]
    assert beside.output_token_ids == alone
    assert eng.timings.spec_rows > 0
    assert_no_leak(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("drafter,k", [("ngram", 1), ("ngram", 3), ("eagle", 1), ("eagle", 3), ("draft_model", 3)])
def test_gpu_graphs_speculation_equals_plain(spec_workload, drafter, k):
    _, ref = run(spec_workload, 2, **GPU_GRAPHS)
    eng, got = run(spec_workload, 2, num_speculative_tokens=k, debug_sync=True, **drafter_cfg(drafter),
                   **GPU_GRAPHS)
    _same(got, ref)
    assert eng.runner.graphs.replays["spec"] > 0, "no spec step ran in a graph"
    assert eng.timings.spec_accepted > 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_gpu_graphs_any_k_step_by_step_equals_plain(spec_workload, drafter):
    """Captured graphs of every level, the spec kernels' finish at each width, the step costs measured at start."""
    _, ref = run(spec_workload, 2, **GPU_GRAPHS)
    eng = LLMEngine(**(CPU | GPU_GRAPHS | dict(depth=2, speculative=drafter, num_speculative_tokens=5)))
    budget = eng.scheduler.spec.budget
    assert budget.sizes and all(budget.costs[(k, 1)] > 0 for k in (0, 1, 3, 5)), budget.costs
    picks = itertools.cycle((5, 1, 0, 3, 5, 3, 1, 0))
    budget.choose = lambda rows: next(picks)
    got = drive(eng, spec_workload)
    _same(got, ref)
    assert eng.runner.graphs.replays["spec"] > 0 and eng.timings.spec_accepted > 0
    assert_no_leak(eng)


def test_policy_pauses_on_low_acceptance_and_probes():
    from engine.speculative.plan import SpecPolicy
    policy = SpecPolicy(k=3, max_rows=8, max_model_len=512, min_acceptance=1.5, probe_every=4)
    assert not policy._paused(), "nothing measured yet: speculate"
    for _ in range(12):
        policy.observe(accepted=2, rows=8)        # 1.25 tokens per row-step
    decisions = [policy._paused() for _ in range(10)]
    assert decisions == [True] * 4 + [False] + [True] * 4 + [False]     # a probe every 5th step
    for _ in range(10):
        policy.observe(accepted=16, rows=8)       # 3 per row-step: the EMA climbs past 1.5
    assert not any(policy._paused() for _ in range(5))


def test_abort_while_speculating_frees_everything(spec_workload):
    """A request aborted with a spec step in flight leaves no KV page and no speculation row behind; the
    other request finishes."""
    prompt = spec_workload[-1][1]
    eng = LLMEngine(**CPU, speculative="ngram", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    a, b = eng.add_request(prompt, params), eng.add_request(prompt, params, retain=True)
    while eng.timings.spec_rows < 2:
        eng.step()
    seq = eng._seqs[a]
    assert seq.pool_row >= 0 and seq.num_pending > 1, "a spec step of the request is in flight"
    eng.abort(a)
    while eng.has_unfinished():
        eng.step()
    assert seq.pool_row == -1 and not seq.block_table
    assert len(eng.take(b).output_token_ids) == 24
    assert_no_leak(eng)
    assert len(eng.scheduler.row_pools[0]) == eng.runner.pool.num_rows


def test_the_kv_page_budget_counts_every_cache_the_block_tables_index():
    """A speculating engine's page costs the target's KV plus its drafter's (a head's one layer, a draft
    model's layers), so the memory fraction holds for all of them together."""
    from engine.memory.kv_cache import KVBudget, PagedCache
    plain = LLMEngine(**CPU, max_num_seqs=2).runner.kv_budget
    head = LLMEngine(**CPU, max_num_seqs=2, speculative="eagle").runner.kv_budget
    draft = LLMEngine(**CPU, max_num_seqs=2, speculative="draft_model", spec_draft_model="default").runner.kv_budget
    target = plain.caches[0]
    assert [c.name for c in plain.caches] == ["target"]
    assert head.caches[1] == PagedCache("eagle head", 1, target.kv_heads, target.head_dim)
    assert draft.caches[1].layers == target.layers and draft.page_bytes == 2 * plain.page_bytes
    assert head.page_bytes == plain.page_bytes * (target.layers + 1) // target.layers
    budget = KVBudget((target,), 16, plain.dtype)
    assert budget.pages_for_memory(10 * budget.page_bytes, 0.5) == 5 and budget.pages_for_memory(0, 0.5) == 1
