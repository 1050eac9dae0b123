"""The draft budget: which K a step verifies, from step costs and the drafts' recent acceptance
(engine/speculative/budget.py). That any K it picks leaves greedy output unchanged: test_spec_engine.py."""
import pytest

from engine.speculative.budget import DraftBudget, levels_for

# a step's seconds by (K, rows): verifying costs little more than a plain step at one row, much more at 32
COSTS = {(0, 1): 1.0, (1, 1): 1.02, (3, 1): 1.06, (6, 1): 1.12,
         (0, 32): 1.0, (1, 32): 1.25, (3, 32): 1.8, (6, 32): 2.7}


def _accepting(budget, rate: float, rows: int = 1000, steps: int = 40) -> None:
    """Steps of rows whose drafts each pass with probability `rate` given the one before passed: rows * rate^a *
    (1 - rate) rows accept exactly a drafts."""
    k = budget.k
    counts = [round(rows * rate ** a * (1 - rate)) for a in range(k)] + [round(rows * rate ** k)]
    for _ in range(steps):
        for accepted, n in enumerate(counts):
            for _ in range(n):
                budget.observe(k, accepted)
        budget.decay()


def test_levels():
    assert levels_for(0) == () and levels_for(1) == (1,) and levels_for(3) == (1, 3)
    assert levels_for(6) == (1, 3, 6) and levels_for(5) == (1, 3, 5)


def test_many_drafts_at_one_row_few_at_many_rows():
    budget = DraftBudget(6, levels_for(6), COSTS)
    _accepting(budget, 0.8)
    assert abs(budget.rate(1) - 0.8) < 0.05 and abs(budget.rate(4) - 0.8) < 0.08
    assert budget.choose(1) == 6                 # 3.95 tokens for 12% more time
    assert budget.choose(20) == 3                # padded to 32 rows: 2.95 / 1.8 beats 3.95 / 2.7 and 1.8 / 1.25


def test_poor_drafts_pause_and_probe():
    budget = DraftBudget(6, levels_for(6), COSTS)
    _accepting(budget, 0.1)
    every = budget.probe_every
    picks = [budget.choose(32) for _ in range(3 * every)]
    assert picks.count(0) == 3 * every - 2, picks
    assert picks[every - 1] == 1 and picks[-1] == 1      # a probe at the best level, now and then
    assert budget.choose(1) == 1                 # at one row even 1.1 tokens for 2% more time pays


def test_probes_that_keep_losing_come_ever_later():
    """Each probe that finds plain steps still better doubles the gap to the next one, up to MAX_PROBE_GAP; once
    drafts pay again the budget speculates at once and probes at the first gap after the next pause."""
    from engine.speculative.budget import MAX_PROBE_GAP
    budget = DraftBudget(6, levels_for(6), COSTS)
    _accepting(budget, 0.1)
    probes = [i for i in range(4000) if budget.choose(32)]
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    every = budget.probe_every
    assert gaps[:5] == [every, 2 * every, 4 * every, 8 * every, min(16 * every, MAX_PROBE_GAP)], gaps
    assert max(gaps) == MAX_PROBE_GAP and gaps[-2] == MAX_PROBE_GAP
    assert budget.plain_next()                          # deep inside a gap: the next step is plain (quiet) too
    _accepting(budget, 0.9)
    assert budget.choose(32) > 0
    _accepting(budget, 0.1, steps=300)                  # the good evidence decays away
    picks = [budget.choose(32) for _ in range(every)]
    assert picks[-1] and not any(picks[:-1]), "the first gap again"


# a tree engine's: a chain of 3 (levels 1 and 3) and a tree of 8 drafts, which costs more than the chain at 1 row
TREE_COSTS = {(0, 1): 1.0, (1, 1): 1.02, (3, 1): 1.06, (8, 1): 1.12, (0, 32): 1.0, (1, 32): 1.25, (3, 32): 1.8,
              (8, 32): 4.0}


def _tree_steps(budget, rows: int, steps: int, chain_rate: float, leaf_rate: float) -> list[int]:
    """`steps` choices at `rows` rows, each committed: a row's chain drafts pass at chain_rate, and where the chain
    stops in a tree step, the leaf there is right at leaf_rate (expected counts, as _accepting)."""
    picks, k, depth = [], budget.k, budget.depth
    for _ in range(steps):
        level = budget.choose(rows)
        picks.append(level)
        tree, drafted = level == k, min(level, depth)
        for a in range(drafted + 1):
            n = 100 * chain_rate ** a * (1 - chain_rate if a < drafted else 1)
            hit = tree and a < drafted
            for accepted, leaf, share in ((a + 1, True, leaf_rate), (a, False, 1 - leaf_rate)) if hit \
                    else ((a, False, 1.0),):
                for _ in range(round(n * share)):
                    budget.observe(drafted, accepted, tree, leaf)
        budget.decay()
    return picks


def test_a_losing_tree_is_probed_and_taken_once_its_leaves_are_right():
    """Leaves are counted only in tree steps: while the chain wins, the tree is verified now and then (gaps doubling
    from probe_every), and once its leaves prove right it is the level at one row. At 32 rows, where even right
    leaves could not pay for it, it is never probed."""
    budget = DraftBudget(8, (1, 3, 8), TREE_COSTS, depth=3)
    every = budget.probe_every
    picks = _tree_steps(budget, 1, 6 * every, chain_rate=0.8, leaf_rate=0.05)
    probes = [i for i, k in enumerate(picks) if k == 8]
    # the prior ranks the tree first; once its leaves count as wrong, it is probed after every, then 2 * every steps
    assert set(picks) == {3, 8} and probes[0] == 0 and [b - a for a, b in zip(probes, probes[1:])] == [every, 2 * every]
    assert _tree_steps(budget, 32, 300, chain_rate=0.8, leaf_rate=0.9).count(8) == 0
    picks = _tree_steps(budget, 1, 40 * every, chain_rate=0.8, leaf_rate=0.9)
    assert picks[-1] == 8 and picks[-every:].count(8) == every, "right leaves make the tree the level"
    assert budget.leaf_hits[1] / budget.leaf_seen[1] > 0.7


def test_rows_without_drafts_count_as_misses():
    """An n-gram drafter finds no match for some rows: they verify nothing and emit one token, so a step yields
    less a row than the drafts' own pass rate says. Half the rows without a draft halve the first position's rate,
    and the budget stops speculating where the drafted rows alone would have paid."""
    def feed(budget, level: int | None):
        for _ in range(40):
            # 50 drafted rows a step, each of 3 drafts passing at 0.6 after the last, and 50 rows with no draft
            for accepted, n in enumerate((20, 12, 7, 11)):
                for _ in range(n):
                    budget.observe(3, accepted, level=level)
            for _ in range(50):
                budget.observe(0, 0, level=level)
            budget.decay()
    costs = {(0, 1): 1.0, (1, 1): 1.02, (3, 1): 1.06, (0, 32): 1.0, (1, 32): 1.35, (3, 32): 1.7}
    counted, drafts_only = DraftBudget(3, (1, 3), costs), DraftBudget(3, (1, 3), costs)
    feed(counted, 3)
    feed(drafts_only, None)
    assert abs(drafts_only.rate(1) - 0.6) < 0.05 and abs(counted.rate(1) - 0.3) < 0.05
    assert abs(counted.rate(2) - 0.6) < 0.05       # past the first position only drafted rows take part
    assert drafts_only.choose(32) == 3 and counted.choose(32) == 0
    assert counted.choose(1) == 3                   # at one row a spec step costs little more than a plain one


def test_a_row_that_drafted_fewer_than_its_level_misses_after_them():
    budget = DraftBudget(6, levels_for(6))
    budget.observe(2, 2, level=6)                   # both drafts passed, nothing at position 3
    budget.observe(6, 6, level=6)
    assert budget.seen[3] - budget.hits[3] == pytest.approx(budget.seen[1] - budget.hits[1] + 1.0)
    budget.observe(2, 2, level=2)                   # a step of level 2: nothing was missed
    assert budget.seen[3] == budget.seen[4] + 1.0


def test_only_rows_that_may_hold_fewer_drafts_miss_after_them():
    """A chain head drafts its step's level for the next step, so a level-6 step after a level-3 one verifies 3
    drafts a row: passing them all is not a miss at position 4. An n-gram row (or one the grammar cut) holds what
    it matched, and is."""
    from types import SimpleNamespace

    from engine.speculative.plan import SpecPolicy, miss_level
    row = SimpleNamespace(spec_k=6)
    head = SpecPolicy(k=6, max_rows=32, max_model_len=512, levels=(1, 3, 6))
    ngram = SpecPolicy(k=6, max_rows=32, max_model_len=512, levels=(1, 3, 6), short_rows=True)
    tree = SpecPolicy(k=16, max_rows=32, max_model_len=512, levels=(1, 3, 6, 16), depth=6, short_rows=True)
    assert miss_level(head, row, False) is None and miss_level(ngram, row, False) == 6
    assert miss_level(tree, SimpleNamespace(spec_k=16), True) == 6
    for policy in (head, ngram):
        policy.budget.observe(3, 3, False, False, miss_level(policy, row, False))
    assert head.budget.seen[4] == ngram.budget.seen[4] - 1.0


def test_without_costs_the_engine_k():
    budget = DraftBudget(3, (1, 2, 3))
    _accepting(budget, 0.05)
    assert budget.choose(1) == 3 and budget.choose(32) == 3


def test_evidence_decays_to_a_floor_not_to_nothing():
    budget = DraftBudget(3, (1, 2, 3), {(k, 1): 1.0 + k / 10 for k in range(4)})
    budget.observe(3, 1)
    for _ in range(100_000):
        budget.decay()
    assert 0 < budget.rate(1) <= 1 and 0 < budget.rate(2) < budget.rate(1)


def test_bad_costs_and_levels_refused():
    with pytest.raises(ValueError, match="levels"):
        DraftBudget(3, (1, 4))
    with pytest.raises(ValueError, match="step cost"):
        DraftBudget(3, (1, 3), {(2, 1): 1.0})
    with pytest.raises(ValueError, match="step cost"):
        DraftBudget(3, (1, 3), {(1, 1): 0.0})


def _decoding_rows(n: int) -> list:
    from types import SimpleNamespace
    return [SimpleNamespace(num_scheduled_tokens=10, max_len=100, schedule_target=11, num_computed_tokens=10,
                            closer=None, params=SimpleNamespace(num_speculative_tokens=None)) for _ in range(n)]


def test_paused_steps_are_quiet_and_a_drafting_step_comes_before_any_spec_step():
    """A plain step whose next step is plain too drafts nothing (quiet); the one before a probe drafts; a step the
    budget would speculate in right after a quiet one drafts instead, and the next one verifies."""
    from engine.speculative.plan import SpecPolicy
    policy = SpecPolicy(k=3, max_rows=32, max_model_len=512, probe_every=4, levels=(1, 3))
    policy.budget.set_costs({key: cost for key, cost in COSTS.items() if key[0] in (0, 1, 3)})
    _accepting(policy.budget, 0.05)
    rows = _decoding_rows(20)
    seen = [(policy.step_k(rows, False, 1000), policy.quiet) for _ in range(12)]
    # probes 4 steps apart, then 8 (each losing probe doubles the gap)
    assert seen == [(0, True), (0, True), (0, False), (1, False)] + [(0, True)] * 6 + [(0, False), (1, False)], seen
    policy.step_k(rows, False, 1000)
    assert policy.quiet
    _accepting(policy.budget, 0.9)               # drafts pass now: speculate, but draft first
    assert (policy.step_k(rows, False, 1000), policy.quiet) == (0, False)
    assert (policy.step_k(rows, False, 1000), policy.quiet) == (3, False)
    assert policy.step_k(rows, True, 1000) == 0 and not policy.quiet, "a step that admits drafts"
    assert policy.plain_step() == 0 and not policy.quiet
