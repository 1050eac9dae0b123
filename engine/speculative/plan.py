"""Host side of speculation: which steps speculate and how far (SpecPolicy), and what a row's step inputs hold
besides its tokens (fill_spec_row, fill_spec_sampling; engine/runner/rows.py writes the tokens), for
engine/runner/spec_step.py.

A step speculates (every row gets 1 + K query tokens: its last token, then K drafts) only when all its
rows are decode rows (guided or not: a guided row's drafts are walked by its grammar), no waiting request could be
admitted instead, there are at most
`max_rows` of them, and the K drafts fit the context. Otherwise it is a plain step (K = 0), which still
records histories and drafts, so the next step can speculate. Each row caps the drafts it may accept
(`num_drafts`): the request's own K, and what keeps max_tokens exact even if every draft passes.

A paused engine (drafts pass too rarely to pay) whose next step will be plain too runs a quiet step: it records
the histories (a head still reads the step's tokens) but drafts nothing, so it costs about what a step of the
engine without speculation costs. Its rows then hold no fresh drafts, so the step after a quiet one never
speculates: it drafts, and the one after it verifies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.speculative.budget import DraftBudget
from engine.speculative.state import SpecStats
from engine.speculative.tree import LEAF


@dataclass
class SpecPolicy:
    k: int                  # the engine's K (graph shapes)
    max_rows: int           # steps with more rows do not speculate
    max_model_len: int
    min_acceptance: float = 0.0     # speculate while the recent acceptance length is at least this
    lookahead: int = 0              # tokens of pages to reserve past a row's inputs when free (head drafts)
    probe_every: int = 16           # below it: one spec step after this many plain ones, to measure again
    levels: tuple = ()              # K values a step may verify (engine/speculative/budget.py); () : K alone
    depth: int = 0                  # a draft tree's chain (engine/speculative/tree.py): k is the tree's drafts
    short_rows: bool = False        # a row may hold fewer drafts than its step asked for (n-gram, draft masks)
    ema: float = field(default=0.0, init=False)     # acceptance length of recent spec steps
    budget: DraftBudget = field(init=False)
    quiet: bool = field(default=False, init=False)  # the step planned last drafts nothing (see the docstring)
    _plain: int = field(default=0, init=False)

    def __post_init__(self):
        self.ema = self.k + 1.0         # optimistic start: a few poor steps do not pause a fresh engine
        self.budget = DraftBudget(self.k, tuple(self.levels) or (self.k,), probe_every=self.probe_every,
                                  depth=self.depth)

    def observe(self, accepted: int, rows: int) -> None:
        """A committed spec step: `rows` rows accepted `accepted` drafts in all (its rows one by one went to
        budget.observe)."""
        if rows:
            self.ema = 0.8 * self.ema + 0.2 * (1 + accepted / rows)
            self.budget.decay()

    def _paused(self) -> bool:
        """Drafts are accepted too rarely to pay for scoring them: plain steps, with a spec step now and then."""
        if self.ema >= self.min_acceptance or self._plain >= self.probe_every:
            self._plain = 0
            return False
        self._plain += 1
        return True

    def plain_step(self) -> int:
        """K of a step that may not speculate for a reason of its own (penalized rows): 0, and it drafts."""
        self.quiet = False
        return 0

    def pages_ahead(self, blocks, seq, n: int, need: int) -> int:
        """Pages for n more tokens of seq, plus `lookahead` tokens when the pages are free now (a head drafts
        up to K - 1 positions past a row's last input; without the pages those drafts are poor, not wrong)."""
        if not self.lookahead:
            return need
        more = blocks.blocks_needed(min(seq.num_computed_tokens + n + self.lookahead, self.max_model_len),
                                    len(seq.block_table))
        return more if more > need and blocks.can_allocate(more) else need

    def request_k(self, seq) -> int:
        want = seq.params.num_speculative_tokens
        return self.k if want is None else min(want, self.k)

    def row_drafts(self, seq, k: int) -> int:
        """Drafts this row may accept: emitting all of them plus the bonus token stays within max_len even if
        the host's optimistic count of the in-flight tokens is right. None while a guided output closes a token
        a step (engine/guided/closing.py): a step of such rows alone is plain."""
        if seq.closer is not None and seq.closer.stepwise:
            return 0
        return max(0, min(k, self.depth or k, self.request_k(seq), seq.max_len - 1 - seq.num_scheduled_tokens))

    def step_k(self, running, could_admit: bool, budget: int) -> int:
        """K for the next step (0: a plain step; `quiet` then says whether it drafts). could_admit: a waiting
        request could join now (it would, in a plain step with its prompt chunk)."""
        was_quiet, self.quiet = self.quiet, False
        k = self._step_k(running, could_admit, budget)
        return 0 if was_quiet else k        # after a quiet step: draft first

    def _step_k(self, running, could_admit: bool, budget: int) -> int:
        if could_admit:
            return 0
        rows = []
        for s in running:
            if s.num_scheduled_tokens < s.max_len and s.schedule_target > s.num_computed_tokens:
                if len(rows) == self.max_rows:      # more rows than speculate: no need to look at the rest
                    return 0
                rows.append(s)
        if not rows:
            return 0
        for s in rows:
            if s.schedule_target - s.num_computed_tokens != 1:
                return 0
        measured = bool(self.budget.sizes)      # step costs known: the budget chooses K, pausing included
        k = self.budget.choose(len(rows)) if measured else self.k
        if not k:
            self.quiet = self.budget.plain_next()
            return 0
        if len(rows) * (k + 1) > budget:
            return 0
        if any(s.num_computed_tokens + k >= self.max_model_len for s in rows):
            return 0
        if not any(self.row_drafts(s, k) for s in rows):
            return 0
        if self.depth and k > self.depth and not all(_verifies_tree(s) for s in rows):
            k = self.depth      # logprobs rows verify the tree's chain
        if measured or not self._paused():
            return k
        self.quiet = self._plain < self.probe_every     # the next step is paused too
        return 0


def _verifies_tree(seq) -> bool:
    """A row a draft tree may verify: without logprobs (greedy, sampled or guided: tree.py, tree_sampling.py)."""
    return seq.params.logprobs is None


def fill_spec_row(slot, i: int, row, t: int, block_size: int) -> None:
    """What a speculating engine's step reads of row i besides its tokens (engine/runner/rows.py wrote those, positions
    and slot mapping as the host plans them: as if the sequence's in-flight drafts all passed): `shift` marks
    that the device must correct them, the next token of each input the host knows, the pages' capacity."""
    h, seq, n, start = slot.np, row.seq, row.num_tokens, row.start
    end, bt = start + n, seq.block_table
    pending = int(seq.num_pending > 0)
    h["next_ids"][t:t + n] = -1                    # the next input of the step, unless known or emitted
    m = min(end, seq.num_tokens - 1) - start        # inputs whose next token the host knows
    if m > 0:
        h["next_ids"][t:t + m] = seq.tokens(start + 1, start + 1 + m)
    h["kv_cap"][i] = len(bt) * block_size
    h["tok_seq"][t:t + n] = i
    h["shift"][t:t + n] = pending
    h["seq_shift"][i] = seq.pool_row if pending else -1


def fill_spec_sampling(slot, s: int, row, t: int) -> None:
    """Sampling row s of a speculating engine's step whose row starts at token t (engine/runner/rows.py wrote the
    rest)."""
    h, seq = slot.np, row.seq
    h["smp_shift"][s] = int(seq.num_pending > 0)
    h["num_drafts"][s] = row.num_drafts
    h["logits_indices"][s] = t if row.spec_k else t + row.num_tokens - 1
    # the inputs whose next token this row emits: -2 - its column in the flattened [S, K + 1] verify output
    k = row.spec_k
    if k:
        h["next_ids"][t:t + k + 1] = range(-2 - s * (k + 1), -3 - s * (k + 1) - k, -1)
    else:
        h["next_ids"][t + row.num_tokens - 1] = -2 - s


def tree_row(policy: SpecPolicy, row, entry: list[int]) -> tuple[bool, bool]:
    """(whether a committed spec row verified a draft tree, whether it accepted one of the tree's leaves)."""
    tree = bool(policy.depth) and row.spec_k == policy.k
    return tree, tree and entry[policy.k] == LEAF


def short_rows(program) -> bool:
    """Whether a spec step program's rows may hold fewer drafts than a step asked for: n-gram matches, drafts the
    grammar cut (SpecPolicy.short_rows)."""
    return program.drafter.uses_history or program.draft_masks is not None


def miss_level(policy: SpecPolicy, row, tree: bool) -> int | None:
    """The level a committed spec row's budget counts a miss after its drafts at (DraftBudget.observe), or None.
    A chain drafter drafts a step's level for the next step, so after a step of a lower level a row holds fewer
    drafts than the next level through no fault of its drafts; only rows that may hold fewer than asked for
    (`short_rows`) miss, at their step's level (a tree step's: its chain's, which a tree engine always drafts)."""
    if not policy.short_rows:
        return None
    return policy.depth if tree else row.spec_k


def commit_row(seq, row, entry: list[int], k: int) -> list[int]:
    """A sampling row's result as the host reads it (`entry`: k + 1 emitted tokens, PAD after them, then
    the drafts verified) -> the tokens to append, and its statistics counted. (The scheduler takes back the
    rejected drafts' computed tokens: Scheduler.rejected.)"""
    tokens = [entry[0]] + [t for t in entry[1:k + 1] if t >= 0]
    if row.spec_k:
        accepted = len(tokens) - 1
        if seq.spec is None:
            seq.spec = SpecStats()
        seq.spec.add(entry[k + 1], accepted)
    return tokens
