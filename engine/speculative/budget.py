"""How many drafts a speculating step verifies: the level of K with the most expected tokens a second at the step's
batch size, from measured step costs and the drafts' recent acceptance.

A row of a step that verifies K drafts emits, on average, E(K) = 1 + sum over j <= K of a_1 * ... * a_j tokens,
where a_j is the recent rate at which a row passed position j when it had passed j - 1 (counted at commit,
decayed step by step; a row with no draft there missed it). The step's cost is the seconds its captured graph
takes at the padded batch size (timed once at start, engine/runner/step_costs.py); K = 0 is the engine's plain
step, one token a row. Every row of the step pays the same cost, so the best K at a batch size is the one with
the largest E(K) / cost(K, rows).

Where a plain step wins the engine stops speculating, and runs one step at the best level now and then
(`probe_every`, the policy's) to measure the acceptance again. A probe costs a drafting step and a losing spec
step, so while probes keep finding plain steps better the gap between them doubles, up to MAX_PROBE_GAP steps;
a choice to speculate brings it back. Without costs (no graphs: eager engines, the CPU) the budget always answers
the engine's K.

A tree engine's leaves are counted only in steps that verify the tree, so a tree that the prior ranks below its
chain would never be tried. While chain levels win, the budget verifies the tree now and then (the same doubling
gaps), wherever leaves that were always right could make it the best level at that batch size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

PRIOR = 0.75            # a draft's acceptance rate before any was counted: start speculating at the largest K
PRIOR_WEIGHT = 4.0      # rows' worth of evidence the prior is worth
LEAF_PRIOR = 0.3        # a tree leaf's rate before any was counted (right where its chain's draft was not)
DECAY = 0.97            # a committed spec step's weight on the counts: about the last 30 steps count
MAX_PROBE_GAP = 256     # plain steps between probes, at most, while probes keep losing


def levels_for(k: int) -> tuple[int, ...]:
    """The K values an engine of K drafts captures steps for: K and 1, and about half of K from K = 4 on (each
    level adds a set of graphs to capture)."""
    if k <= 0:
        return ()
    return tuple(sorted({1, (k + 1) // 2, k} if k >= 4 else {1, k}))


def engine_levels(config) -> tuple[int, ...]:
    """The levels of an EngineConfig: levels_for(K) with Tuning.spec_budget, else K alone. A tree engine's are its
    chain's levels and the tree's drafts (engine/speculative/tree.py)."""
    k = config.spec_k
    if config.tuning.spec_tree:
        depth = config.num_speculative_tokens
        return (levels_for(depth) if config.tuning.spec_budget else (depth,)) + (k,)
    return levels_for(k) if config.tuning.spec_budget else ((k,) if k else ())


@dataclass
class DraftBudget:
    k: int                                  # the engine's K: the drafts a row holds
    levels: tuple[int, ...]                 # K values a step may verify (graphs exist for each)
    costs: dict = field(default_factory=dict)   # {(K, padded rows): seconds a step}; K = 0: a plain step
    probe_every: int = 16                   # a measuring spec step in this many while plain steps win
    depth: int = 0                          # a tree engine's chain: level k is then a tree of k drafts
    hits: list = field(init=False)          # hits[j] / seen[j]: draft j's acceptance rate given draft j - 1 passed
    seen: list = field(init=False)
    _plain: int = field(default=0, init=False)
    _gap: int = field(default=0, init=False)        # plain steps before the next probe
    _chain: int = field(default=0, init=False)      # chain steps since the tree was verified (tree engines)
    _tree_gap: int = field(default=0, init=False)   # chain steps before the next tree probe

    def __post_init__(self):
        if any(not 1 <= level <= self.k for level in self.levels):
            raise ValueError(f"draft levels {self.levels} must lie in [1, {self.k}]")
        self._gap = self._tree_gap = self.probe_every
        self.hits = [PRIOR * PRIOR_WEIGHT] * (self.k + 1)
        self.seen = [PRIOR_WEIGHT] * (self.k + 1)
        # leaf_hits[j] / leaf_seen[j]: a tree's leaf at depth j was right where its chain's draft j was not
        self.leaf_hits = [LEAF_PRIOR * PRIOR_WEIGHT] * (self.k + 1)
        self.leaf_seen = [PRIOR_WEIGHT] * (self.k + 1)
        self.set_costs(self.costs)

    def set_costs(self, costs: dict) -> None:
        """Step seconds by (K, padded rows): a plain step's (K = 0) and each level's at the same rows."""
        for (k, rows), seconds in costs.items():
            if k not in (0, *self.levels) or rows < 1 or not seconds > 0:
                raise ValueError(f"step cost ({k}, {rows}) -> {seconds!r}: K must be 0 or a level of "
                                 f"{self.levels}, rows positive, seconds positive")
        self.costs = dict(costs)
        sizes = {rows for _, rows in costs}
        self.sizes = sorted(r for r in sizes if all((k, r) in costs for k in (0, *self.levels)))

    def rate(self, j: int) -> float:
        return self.hits[j] / self.seen[j]

    def expected(self, k: int, leaf_rate: float | None = None) -> float:
        """Tokens a row emits, on average, in a step verifying k drafts (a tree's: its chain's, plus a token where
        the chain stops at a depth whose leaf is right; `leaf_rate`: that rate at every depth, for the counted
        ones)."""
        tree = bool(self.depth) and k > self.depth
        total = passed = 1.0
        for j in range(1, (self.depth if tree else k) + 1):
            if tree:
                leaf = self.leaf_hits[j] / self.leaf_seen[j] if leaf_rate is None else leaf_rate
                total += passed * (1.0 - self.rate(j)) * leaf
            passed *= self.rate(j)
            total += passed
        return total

    def choose(self, rows: int) -> int:
        """K for a step of `rows` speculating rows (0: a plain step)."""
        if not self.sizes:
            return self.k
        i = bisect.bisect_left(self.sizes, rows)
        padded = self.sizes[min(i, len(self.sizes) - 1)]
        best = max(self.levels, key=lambda k: self.expected(k) / self.costs[(k, padded)])
        if self.expected(best) / self.costs[(best, padded)] > 1.0 / self.costs[(0, padded)]:
            self._plain, self._gap = 0, self.probe_every
            return self._tree_probe(best, padded)
        self._plain += 1
        if self._plain >= self._gap:
            self._plain, self._gap = 0, self._doubled(self._gap)
            return best
        return 0

    def _tree_probe(self, best: int, padded: int) -> int:
        """`best`, or in a tree engine whose chain wins the tree now and then: where right leaves could make it
        the best level here, once a gap of chain steps has passed (the gap doubles each time, up to
        MAX_PROBE_GAP; the tree winning on its counts brings it back)."""
        tree = self.k
        if not self.depth or tree not in self.levels:
            return best
        if best == tree:
            self._chain, self._tree_gap = 0, self.probe_every
            return best
        if self.expected(tree, 1.0) / self.costs[(tree, padded)] <= self.expected(best) / self.costs[(best, padded)]:
            return best
        self._chain += 1
        if self._chain < self._tree_gap:
            return best
        self._chain, self._tree_gap = 0, self._doubled(self._tree_gap)
        return tree

    def _doubled(self, gap: int) -> int:
        """A probe gap after a losing probe: twice as long, up to MAX_PROBE_GAP (or probe_every, if longer)."""
        return min(2 * gap, max(MAX_PROBE_GAP, self.probe_every))

    def plain_next(self) -> bool:
        """After `choose` answered 0: the next step is plain too, unless new evidence or another batch size changes
        the answer (it is not the probe's turn)."""
        return 0 < self._plain < self._gap - 1

    def observe(self, drafted: int, accepted: int, tree: bool = False, leaf: bool = False,
                level: int | None = None) -> None:
        """A committed row that verified `drafted` drafts and accepted the first `accepted` of them; `tree`: as a
        tree, `leaf`: the last accepted was a leaf (its chain stopped one draft before). `level`: the drafts its
        step let it verify (a tree step's: its chain's). A row that drafted fewer and passed them all missed at
        the next position: like a rejected draft it emits nothing more, so the rates count what a step at that
        level yields a row (an n-gram drafter's rows without a match yield one token), not what drafts alone
        would."""
        chain = accepted - leaf
        for j in range(1, min(chain, self.k) + 1):
            self.hits[j] += 1.0
            self.seen[j] += 1.0
        if chain < drafted <= self.k:
            self.seen[chain + 1] += 1.0
            if tree:
                self.leaf_hits[chain + 1] += float(leaf)
                self.leaf_seen[chain + 1] += 1.0
        elif level is not None and chain == drafted < min(level, self.k):
            self.seen[chain + 1] += 1.0

    def decay(self) -> None:
        """After a committed spec step's rows: older steps count less, down to PRIOR_WEIGHT rows' worth of evidence
        a position (a position no step verifies lately keeps its last rate)."""
        for hits, seen in ((self.hits, self.seen), (self.leaf_hits, self.leaf_seen)):
            for j, n in enumerate(seen):
                if n > PRIOR_WEIGHT:
                    f = max(DECAY, PRIOR_WEIGHT / n)
                    hits[j], seen[j] = hits[j] * f, n * f
