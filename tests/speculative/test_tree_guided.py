"""Guided rows verify draft trees.

The grammar's walk of a tree (engine/guided/matching.py walk_tree, and the grammar node's in native code): every
input's mask is its path's (the chain's first depth - 1 drafts, then the leaf), a leaf the grammar rejects keeps an
all-allowed mask, the cap is one past the chain drafts the grammar accepted unless the matcher terminated there,
and each matcher ends exactly where it began. Hundreds of steps of a tree of depth 2 with true, wrong and invalid
drafts, both paths against a reference walked on forks of a matcher fed only the committed tokens. Then the engine:
greedy guided output equals the guided engine's without speculation, token for token.
"""
import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch

from conftest import assert_no_leak
from engine.guided.masks import GrammarMasks
from engine.guided.snapshot import Snapshot
from engine.guided.matching import GuidedRow
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from engine.speculative.tree import DraftTree
from helpers import EagerGraphs, drive, service
from test_spec_guided import CPU, check_valid, matchers_fed_exactly_the_committed_tokens, reference, run, same_greedy  # noqa: F401
from test_tree_engine import count_leaf_hits
from test_spec_guided_rollback import ITEMS, Row, same_state

TREE = DraftTree.of_size(2, 7)      # chain of 2; leaves (1, 1), (2, 1), (1, 2), (2, 2), (1, 3)
N, D = TREE.nodes, TREE.depth


def walk_reference(fresh, drafts, count, words):
    """(cap, chain drafts the grammar accepted, the mask of each of the 1 + N inputs) walked on forks of the matcher
    fed the committed tokens."""
    masks = [np.full(words, -1, dtype=np.int32) for _ in range(N + 1)]

    def fill(m, i):
        t = torch.zeros(1, words, dtype=torch.int32)
        m.fill_next_token_bitmask(t)
        masks[i] = t[0].numpy()
    m = fresh.fork()
    fill(m, 0)
    walked, ended = 0, False
    for j in range(min(D, count)):
        if not m.accept_token(int(drafts[j])):
            break
        walked += 1
        ended = m.is_terminated()
        if ended:
            break
        fill(m, j + 1)
    cap = min(count, walked + (not ended))
    for i, (depth, _) in enumerate(TREE.leaves):
        if depth > cap or drafts[D + i] == drafts[depth - 1]:      # a leaf repeating its chain sibling: skipped
            continue
        m = fresh.fork()
        assert all(m.accept_token(int(t)) for t in drafts[:depth - 1])
        if m.accept_token(int(drafts[D + i])) and not m.is_terminated():
            fill(m, D + 1 + i)
    return cap, walked, masks


class TreeRow(Row):
    def drafts(self, rng, t0, vocab):
        """Chain: the true tokens for a random number of them, then wrong ones; leaves: true, wrong or invalid."""
        true = self.stream[t0:t0 + D + 1] + [self.stream[-1]] * (D + 1)
        good = rng.randint(0, D)
        chain = true[:good] + [rng.randrange(vocab) for _ in range(D - good)]
        leaves = [true[depth - 1] if rng.random() < 0.3 else rng.randrange(vocab) for depth, _ in TREE.leaves]
        return chain + leaves


@pytest.mark.parametrize("python", [False, True], ids=["native", "python"])
def test_tree_walk_masks_caps_and_rollback(engine, python):
    vocab, rng = engine.runner.vocab, random.Random(1)
    compiled = service(engine).compile_now(SamplingParams(json_schema=ITEMS).guide)
    rows = [TreeRow(engine, compiled, seed) for seed in (3, 4)]
    masks = GrammarMasks(vocab, 4, torch.device("cpu"), k=N, python=python, tree=TREE)
    steps = leaves_walked = beside_rejected = 0
    for step in range(600):
        slot, prev = step % 2, 1 - step % 2
        live = [(i, r) for i, r in enumerate(rows) if r.committed + len(r.emitted) < len(r.stream) - 1]
        if not live:
            break
        snap_rows = []
        for i, r in live:
            masks.tokens_np[prev][i] = -1
            masks.tokens_np[prev][i, :len(r.emitted)] = r.emitted
            lo = r.g.accepted
            snap_rows.append(GuidedRow(i, r.g, lo, tuple(r.stream[lo:r.committed]), i if r.emitted else -1, step - 1))
            masks.drafts_np[slot][i, :N] = r.drafts(rng, r.committed + len(r.emitted), vocab)
            masks.drafts_np[slot][i, N] = rng.choice((D, D, 1, 0))
        masks.push(Snapshot(slot, prev, tuple(snap_rows), np.zeros(0, dtype=np.int64), step, N + 1))
        masks.run()
        steps += 1
        for gr in snap_rows:
            r = rows[gr.row]
            assert r.g.error is None, r.g.error
            t0 = r.committed + len(r.emitted)
            r.feed_fresh(t0)
            assert same_state(r.g.matcher, r.fresh, vocab), f"step {step}: the tree walk did not roll back"
            drafts, count = masks.drafts_np[slot][gr.row, :N], int(masks.drafts_np[slot][gr.row, N])
            cap, walked, want = walk_reference(r.fresh, drafts, count, masks.words)
            assert masks.caps_np[slot][gr.row] == cap, step
            got = masks.host_np[slot][gr.row * (N + 1):(gr.row + 1) * (N + 1)]
            for i in range(N + 1):
                assert np.array_equal(got[i], want[i]), f"step {step}: input {i}'s mask"
            leaves_walked += sum(not np.all(want[D + 1 + i] == -1) for i in range(N - D))
            beside_rejected += cap == walked + 1 and walked < min(D, count)    # a leaf beside a rejected draft
            # the step emits 1 to D + 1 true tokens
            r.committed, r.emitted = t0, r.stream[t0:t0 + rng.randint(1, D + 1)]
    assert steps > 100 and leaves_walked > 50 and beside_rejected > 5, (steps, leaves_walked, beside_rejected)


# ---- the engine: guided rows verify the tree -------------------------------------------------------------
GUIDED_TREE = dict(speculative="eagle", num_speculative_tokens=2, spec_tree=12)


@pytest.fixture
def guided_leaf_hits(monkeypatch):
    """Rows of guided steps that accepted a leaf (greedy verification; a guided step passes leaf_ok)."""
    return count_leaf_hits(monkeypatch, guided_only=True)


@pytest.fixture(scope="module")
def long_workload(guided_workload):
    """The guided workload with twice its token budgets: rows draft longer before their closing zone."""
    return [(at, prompt, dataclasses.replace(params, max_tokens=2 * params.max_tokens))
            for at, prompt, params in guided_workload]


@pytest.fixture(scope="module")
def long_reference(long_workload):
    return run(long_workload, depth=1)[1]


@pytest.mark.parametrize("node,depth,graph_layout,draft", [("native", 2, False, ""), ("python", 1, True, ""),
                                                          ("native", 2, True, "masks"),
                                                          ("python", 2, False, "masks+forced")])
def test_guided_tree_equals_guided(long_workload, long_reference, guided_leaf_hits, node, depth, graph_layout, draft):
    """Guided rows (JSON schemas, a regex, a choice; greedy and one sampled) and an unguided one verify the tree under
    their grammar's masks: greedy outputs equal the guided engine's without speculation, every output validates,
    each matcher was fed exactly the committed tokens, and no KV page or row leaks. `draft`: the head drafts the
    chain and ranks the leaves under the grammar's draft masks (the native draft nodes), and with forced drafts
    (the Python draft callbacks)."""
    eng, got = run(long_workload, depth, graph_layout, grammar_node=node, guided_draft_masks="masks" in draft,
                   guided_forced_drafts="forced" in draft, **GUIDED_TREE)
    assert (eng.runner.program.draft_masks is None) == (not draft)
    same_greedy(long_workload, got, long_reference)
    check_valid(long_workload, got)
    matchers_fed_exactly_the_committed_tokens(got, eng.runner.vocab)
    assert guided_leaf_hits[0] > 0, "no guided row accepted a leaf"
    assert eng.timings.spec_leaves >= guided_leaf_hits[0] and eng.timings.spec_accepted > 0
    if graph_layout:
        assert eng.runner.graphs.replays["spec"] > 0


def test_guided_tree_any_level_step_by_step(guided_workload, reference):
    """The budget's choices in turn (the tree, the chain's levels, plain steps): a guided row's grammar walks a chain
    or the tree by the step's width, and greedy output stays the guided engine's."""
    eng = LLMEngine(**(CPU | dict(depth=2) | GUIDED_TREE))
    eng.runner.graphs = EagerGraphs(eng.runner, guided=True)
    budget = eng.scheduler.spec.budget
    assert budget.levels == (1, 2, 12)
    budget.set_costs({(k, r): 1.0 for k in (0, 1, 2, 12) for r in (1, 2, 4, 8)})
    picks = itertools.cycle((12, 1, 0, 12, 2, 12, 0, 1))
    budget.choose = lambda rows: next(picks)
    got = drive(eng, guided_workload)
    same_greedy(guided_workload, got, reference)
    check_valid(guided_workload, got)
    matchers_fed_exactly_the_committed_tokens(got, eng.runner.vocab)
    assert eng.timings.spec_accepted > 0 and eng.runner.graphs.replays["spec"] > 0
    assert_no_leak(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("masks", [False, True], ids=["head", "draft-masks"])
def test_gpu_graphs_guided_tree_equals_guided(guided_workload, masks):
    """CUDA graphs, the grammar node on the driver thread walking the tree, the Triton backend, float32; with draft
    masks, the native draft nodes in each drafting step's graph too."""
    from test_spec_guided import GPU_GRAPHS
    _, ref = run(guided_workload, **GPU_GRAPHS)
    eng, got = run(guided_workload, **(GPU_GRAPHS | GUIDED_TREE | dict(debug_sync=True, guided_draft_masks=masks)))
    same_greedy(guided_workload, got, ref)
    check_valid(guided_workload, got)
    matchers_fed_exactly_the_committed_tokens(got, eng.runner.vocab)
    assert eng.runner.graphs.replays["spec"] > 0 and eng.timings.spec_accepted > 0
    assert not eng.runner.masks.queue
