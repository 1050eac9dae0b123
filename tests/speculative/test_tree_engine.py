"""Draft trees in the engine (Tuning.spec_tree): greedy output equals the plain engine's, token for token, with
leaves accepted and their keys moved; sampled rows verify the tree too, from their own seeds; nothing leaks.

The workload and its references are test_spec_engine's (EOS, stop string, stop token, max_tokens, late arrivals,
preemption, and answers that repeat themselves).
"""
import itertools

import pytest

import engine.runner.tree_step as tree_step
from conftest import assert_no_leak
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CPU, PREEMPTING, ROOMY, EagerGraphs, drive, record_steps
from test_spec_engine import _same, reference, run, spec_workload  # noqa: F401 (fixtures)

TREE = dict(speculative="eagle", num_speculative_tokens=3, spec_tree=8)


def count_leaf_hits(monkeypatch, guided_only: bool = False) -> list:
    """[rows that accepted a leaf], counted as the engine verifies greedily (`guided_only`: in guided steps, which
    pass leaf_ok)."""
    hits, accept = [0], tree_step.tree_accept

    def counted(*args, **kwargs):
        out = accept(*args, **kwargs)
        if not guided_only or kwargs.get("leaf_ok") is not None:
            hits[0] += int(out[3].sum())
        return out
    monkeypatch.setattr(tree_step, "tree_accept", counted)
    return hits


@pytest.fixture
def leaf_hits(monkeypatch):
    return count_leaf_hits(monkeypatch)


@pytest.mark.parametrize("depth,cfg,graph_layout", [(2, "roomy", False), (1, "preempting", False),
                                                    (2, "roomy", True)])
def test_greedy_tree_equals_plain(spec_workload, reference, leaf_hits, depth, cfg, graph_layout):
    eng, got = run(spec_workload, depth, graph_layout, **TREE, **(ROOMY if cfg == "roomy" else PREEMPTING))
    _same(got, reference[cfg])
    t = eng.timings
    assert t.spec_rows > 0 and leaf_hits[0] > 0, "no leaf was accepted"
    assert 0 < t.spec_leaves <= leaf_hits[0]      # (verification also counts padding and zombie rows)
    assert t.spec_leaves <= t.spec_levels.get(TREE["spec_tree"], 0), t.spec_levels    # leaves in tree rows only
    assert 1.0 < t.acceptance_length <= 4
    if graph_layout:
        assert eng.runner.graphs.replays["spec"] > 0
    if cfg == "preempting":
        assert eng.scheduler.num_preemptions > 0


def test_sampled_rows_verify_the_tree(spec_workload, reference, monkeypatch):
    """A sampled request beside the greedy ones: every step verifies the tree (lossless sampling for the sampled
    row: engine/speculative/tree_sampling.py), and the greedy outputs stay the plain engine's."""
    sampled_steps, sample = [], tree_step.tree_rejection_sample
    monkeypatch.setattr(tree_step, "tree_rejection_sample",
                        lambda *a, **kw: sampled_steps.append(1) or sample(*a, **kw))
    eng = LLMEngine(**CPU, depth=2, **TREE)
    log = record_steps(eng)
    last = max(w[0] for w in spec_workload)       # drive returns requests in arrival order: this one last
    sampled = (last, spec_workload[-1][1], SamplingParams(max_tokens=24, temperature=0.8, seed=5))
    seqs = drive(eng, list(spec_workload) + [sampled])
    _same(seqs[:-1], reference["roomy"])
    assert seqs[-1].finish_reason == "length" and len(seqs[-1].output_token_ids) == 24
    assert {k for k, _, _ in log} <= {0, 8} and 8 in {k for k, _, _ in log} and sampled_steps, log
    assert_no_leak(eng)
    assert len(eng.scheduler.row_pools[0]) == eng.runner.pool.num_rows


def test_seeded_sampling_through_a_tree_is_reproducible_across_batches(spec_workload):
    """A sampled row's tree verification draws from its own seed: alone or beside a greedy request (admitted in the
    same step, every step speculating alike) it emits the same tokens."""
    prompt, other = spec_workload[-1][1], spec_workload[-2][1]
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)
    alone = LLMEngine(**CPU, **TREE, spec_min_acceptance=0.0).generate([prompt], params)[0].output_token_ids
    eng = LLMEngine(**CPU, **TREE, spec_min_acceptance=0.0)
    beside = eng.generate([other, prompt], [SamplingParams(max_tokens=24, temperature=0), params])[1]
    assert beside.output_token_ids == alone
    assert eng.timings.spec_rows > 0
    assert_no_leak(eng)


def test_logprobs_rows_verify_the_chain(spec_workload):
    """A step holding a row that asks for logprobs is an extras step, which a tree step never is: it verifies the
    tree's chain, and the tree again once that row is done. Tokens and logprobs stay the plain engine's."""
    prompt = spec_workload[-1][1]
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    plain = LLMEngine(**CPU).generate([prompt, prompt], params)
    eng = LLMEngine(**CPU, **TREE, spec_min_acceptance=0.0)
    log = record_steps(eng)
    got = eng.generate([prompt, prompt], params)
    assert [s.output_token_ids for s in got] == [s.output_token_ids for s in plain]
    (lp, top), (lp0, top0) = zip(*got[0].logprobs), zip(*plain[0].logprobs)
    assert len(lp) == 12 and got[1].logprobs is None
    assert [[t for t, _ in e] for e in top] == [[t for t, _ in e] for e in top0]
    assert lp == pytest.approx(lp0, abs=1e-4)
    ks = [k for k, _, _ in log if k]
    assert ks[0] == 3 and 8 in ks and ks == sorted(ks), ks     # the chain while the logprobs row runs, then the tree
    assert_no_leak(eng)


def test_tree_settings_are_checked():
    with pytest.raises(ValueError, match="speculative='eagle'"):
        LLMEngine(**CPU, speculative="ngram", spec_tree=8)
    with pytest.raises(ValueError, match="more than num_speculative_tokens"):
        LLMEngine(**CPU, speculative="eagle", num_speculative_tokens=3, spec_tree=3)
    with pytest.raises(ValueError, match="at most 32"):
        LLMEngine(**CPU, speculative="eagle", num_speculative_tokens=3, spec_tree=33)


@pytest.mark.gpu
def test_gpu_graphs_tree_equals_plain(spec_workload):
    """CUDA graphs on the Triton backend (the tree's masks in the paged kernel, RoPE fused into it, the candidates
    from the top-k kernels), float32. Without the budget every spec step verifies the tree: with it, measured costs
    may keep a workload this short on the chain (test_spec_budget.py tests its tree probes)."""
    from test_spec_engine import GPU_GRAPHS
    _, ref = run(spec_workload, 2, **GPU_GRAPHS)
    eng, got = run(spec_workload, 2, **TREE, **GPU_GRAPHS, spec_budget=False)
    _same(got, ref)
    assert eng.timings.spec_rows > 0 and eng.timings.spec_leaves > 0


def test_any_level_step_by_step_changes_no_token(spec_workload, reference):
    """The budget's choices in turn (the tree, each chain level, plain and quiet steps) in the graphs' padded layouts:
    a chain step verifies the first drafts of a tree's, and greedy output stays the plain engine's."""
    eng = LLMEngine(**CPU, depth=2, **TREE)
    eng.runner.graphs = EagerGraphs(eng.runner)
    budget = eng.scheduler.spec.budget
    assert budget.levels == (1, 3, 8)
    budget.set_costs({(k, r): 1.0 for k in (0, 1, 3, 8) for r in (1, 2, 4, 8)})
    picks = itertools.cycle((8, 1, 0, 0, 3, 8, 8, 0, 1, 3))
    budget.choose, budget.plain_next = (lambda rows: next(picks)), (lambda: True)
    log = record_steps(eng)
    _same(drive(eng, spec_workload), reference["roomy"])
    assert {k for k, _, _ in log} >= {0, 1, 3, 8} and any(q for _, q, _ in log), log
    assert eng.timings.spec_leaves > 0
    assert_no_leak(eng)
