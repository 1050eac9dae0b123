"""Continuous batching: admission, chunked prefill, preemption by recompute.

Every step is one mixed batch under a token budget: running sequences first (decode rows take one
token, a partially prefilled prompt takes the next chunk), then waiting sequences in arrival order.
When a running sequence needs a page and none is free, the most recently admitted other sequence is
preempted: its pages are freed and it is re-queued to recompute prompt + outputs later.

With the pipelined loop a sequence may have one token sampled on the device but not yet committed
(`num_pending`); the scheduler plans with `num_scheduled_tokens`, which counts it, and the runner feeds
that token to the next step straight from device memory (carry-over). A sequence whose last token is
already in flight (`capped`) is not scheduled again: it ends at that token's commit. A guided request
whose grammar is still compiling prefills all but its last prompt token (`schedule_target`).
A sequence's in-flight counters (`inflight_refs`, `num_pending`, `pending_src`, and `num_computed_tokens` as
steps launch and land) change only here: `launched`, `landed`, `rejected`, preemption and release.
Prefix caching (engine/memory/prefix_map.py): an admitted sequence maps the cached pages of its longest known
prefix (all but its last token: one is left to compute) and starts computing after them; its full prompt pages are
registered as their step is launched, the pages of its outputs when it gives its pages back (release, preemption).
Preemption frees pages at once even if a launched step still writes them: every KV writer runs on the
one compute stream, so the new owner's writes are ordered after the old owner's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.memory.block_manager import BlockManager
from engine.memory.prefix_map import PrefixMap
from engine.requests import _hostpath
from engine.requests.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    start: int          # first position computed in this step
    num_tokens: int     # new tokens computed in this step
    sample: bool        # this row ends at the sequence's last token, so it yields a new token
    sample_idx: int = -1  # its row in the step's sampled tokens (set by the runner)
    spec_k: int = 0     # speculation: the step's draft slots (num_tokens = 1 + spec_k), 0 in a plain step
    num_drafts: int = 0  # drafts this row may accept (<= spec_k)
    epoch: int = 0      # seq.num_preemptions at launch: a commit rolls back only a sequence not preempted since
    cached: int = 0     # the row of an admission: tokens before `start` mapped from the prefix cache


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, spec=None,
                 row_pools=()):
        self.blocks = block_manager
        self.spec = spec            # SpecPolicy (engine/speculative/plan.py) when the engine speculates
        # RowPools of per-sequence device rows, handed out with pages and taken back with them: the token
        # pool's (engine/memory/token_pool.py; every sequence), the penalties' (engine/sampling/penalties.py;
        # penalized ones)
        self.row_pools = list(row_pools)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix = PrefixMap(block_manager)
        self.closing: list[Sequence] = []   # the last schedule's rows whose whole rest is a forced closing
        self.native = True          # runs of common decode rows and launched counters in native code
                                    # (engine/requests/csrc/hostpath.cpp); False: all in Python, their definition

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRow]:
        """The next step's rows. Rows that need no step go to `closing` instead: the engine commits their forced
        closings at once (Commits.close)."""
        rows: list[ScheduledRow] = []
        self.closing = []
        budget = self.max_num_batched_tokens
        k = 0
        if self.spec is not None:
            k = self.spec.step_k(self.running, self._could_admit(budget), budget)
            if k and any(s.params.penalized for s in self.running):    # penalized rows never speculate
                k = self.spec.plain_step()
        budget = self._schedule_running(rows, budget, k)
        if not k:
            self._admit_waiting(rows, budget)
        return rows

    def _schedule_running(self, rows, budget, k: int = 0) -> int:
        i, page_tokens, running, spec = 0, self.blocks.block_size, self.running, self.spec
        # a plain step's rows need nothing else, unless a head drafts after them into pages reserved ahead
        plain = not k and (spec is None or not spec.lookahead or len(running) > spec.max_rows)
        while i < len(running) and budget > 0:
            if plain and self.native:           # a run of the rows below that need nothing else, in one call
                i, budget = _hostpath.schedule_decode(running, i, budget, page_tokens, rows, ScheduledRow,
                                                       self.blocks)
                if i >= len(running) or budget <= 0:
                    break
            seq = running[i]
            scheduled = seq.num_scheduled_tokens          # read once: seq.schedule_target is this less grammar_blocked
            computed = seq.num_computed_tokens
            n = min(scheduled - seq.grammar_blocked - computed, budget)
            # nothing new, capped, or a guided output about to close (its token in flight, or its closing due)
            if n <= 0 or scheduled >= seq.max_len or (seq.closer is not None and self._holds(seq)):
                i += 1
                continue
            if plain and n == 1 and computed < len(seq.block_table) * page_tokens:
                # the common decode row: within its pages (no reservation), its one token samples. Positional
                # (seq, start, num_tokens, sample, sample_idx, spec_k, num_drafts, epoch): a keyword costs here
                rows.append(ScheduledRow(seq, computed, 1, computed + 1 == scheduled, -1, 0, 0, seq.num_preemptions))
                budget -= 1
                i += 1
                continue
            n = n + k                           # a spec step: the last token and k drafts
            # (a plain step's row within its pages needs no reservation)
            fits = plain and computed + n <= len(seq.block_table) * page_tokens
            if not fits and not self._reserve(seq, n, victims_after=i):
                continue                        # seq itself was preempted; running[i] is the next one
            rows.append(self._row(seq, n, k, scheduled))
            budget -= n
            i += 1
        return budget

    def _holds(self, seq: Sequence) -> bool:
        """Whether a guided row sits out this step: it waits for its token in flight before closing, or the rest
        of its output is a forced closing that needs no step (it joins `closing`)."""
        if seq.closer.hold(seq):
            return True
        if seq.closer.closes_now(seq):
            self.closing.append(seq)
            return True
        return False

    def _could_admit(self, budget: int) -> bool:
        """Whether _admit_waiting would admit a request now (the first it would try has the pages)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        for seq in self.waiting:
            n = self._first_chunk(seq, budget)
            if n:
                return self.blocks.can_allocate(self._pages_for(seq, n))
        return False

    def _first_chunk(self, seq, budget: int) -> int:
        """Tokens a waiting sequence would compute if admitted now; 0: it must wait."""
        if seq.capped:                          # preempted with its last token in flight: ends at commit
            return 0
        if seq.num_pending:     # preempted with a token in flight: it lands on the row it had (and with speculation
            return 0            # how many of its drafts pass is known at commit only), so recompute after it
        # <= 0: only its sampling token is left, and its grammar is not ready
        return max(0, min(seq.schedule_target - seq.num_computed_tokens, budget))

    def _pages_for(self, seq, n: int) -> int:
        need = self.blocks.blocks_needed(seq.num_computed_tokens + n, len(seq.block_table))
        return self.spec.pages_ahead(self.blocks, seq, n, need) if self.spec else need

    def _reserve(self, seq, n, victims_after) -> bool:
        need = self._pages_for(seq, n)
        if need == 0:
            return True
        while not self.blocks.can_allocate(need):
            if len(self.running) - 1 > victims_after:
                self.preempt(self.running[-1])
            else:
                self.preempt(seq)
                return False
        seq.block_table += self.blocks.allocate(need)
        return True

    def _admit_waiting(self, rows, budget) -> None:
        computing = None        # digests of the pages this step's rows compute, built when first needed
        deferred = 0
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs or deferred > self.max_num_seqs:
                break           # (a burst of requests behind one head: look up at most a batch of them a step)
            n = self._first_chunk(seq, budget)
            if not n:
                continue
            matched = self.prefix.match(seq)
            if self.prefix.next_page_uncached(seq):
                computing = self.prefix.computing(rows) if computing is None else computing
                if seq.block_digests[len(seq.block_table)] in computing:
                    self.prefix.unmatch(seq)  # its next page is computed in this step: take it from the cache next step
                    deferred += 1       # instead of computing the same prefix twice
                    continue
            if matched:
                n = self._first_chunk(seq, budget)
                if not n:                       # its cached prefix covers what it may compute now
                    self.prefix.unmatch(seq)
                    continue
            need = self._pages_for(seq, n)
            if not self.blocks.can_allocate(need) or not self._take_rows(seq):
                self.prefix.unmatch(seq)
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = matched
                self.blocks.count_query(len(seq.prompt_token_ids), matched)
            self.waiting.remove(seq)
            seq.block_table += self.blocks.allocate(need)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.closer is not None:
                seq.closer.hold(seq)            # its first token may already be a closing's (nothing is in flight)
            rows.append(self._row(seq, n))
            rows[-1].cached = matched
            budget -= n
            if computing is not None:
                computing.update(self.prefix.row_pages(rows[-1]))

    def _row(self, seq, n, k: int = 0, scheduled: int | None = None) -> ScheduledRow:
        """scheduled: seq.num_scheduled_tokens where the caller has it."""
        start = seq.num_computed_tokens
        scheduled = seq.num_scheduled_tokens if scheduled is None else scheduled
        row = ScheduledRow(seq, start, n, sample=start + n - k == scheduled, spec_k=k, epoch=seq.num_preemptions)
        if k:
            row.num_drafts = self.spec.row_drafts(seq, k)
        return row

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.prefix.release(seq)
        self._give_rows_back(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- a step's rows in flight: the only places a sequence's counters change ------------------------
    def launched(self, rows: list[ScheduledRow]) -> None:
        """A step holding `rows` was enqueued: each row holds its sequence until the step lands, its tokens
        count as computed, and a sampling row's tokens are pending (every draft counted as if it passed)."""
        caching, page_tokens = self.blocks.caching, self.blocks.block_size
        if self.native:                         # the same counters in one call; then the same registrations
            for seq in _hostpath.launched(rows, caching, page_tokens):
                self.prefix.register(seq)
            return
        for row in rows:
            seq = row.seq
            seq.inflight_refs += 1
            seq.num_computed_tokens = row.start + row.num_tokens
            if row.sample:
                seq.num_pending += 1 + row.spec_k
                seq.pending_src = row.sample_idx
            if caching and min(seq.num_computed_tokens, len(seq.prompt_token_ids)) // page_tokens > seq.num_registered:
                self.prefix.register(seq)     # (the test first: this runs for every row of every step)

    def landed(self, row: ScheduledRow) -> bool:
        """The step holding `row` was committed or will never be: the row stops holding its sequence. False:
        the sequence is finished (a zombie row; its pages go back once no step holds it)."""
        seq = row.seq
        seq.inflight_refs -= 1
        if row.sample:
            seq.num_pending -= 1 + row.spec_k
        if seq.finalized:
            self.release_if_idle(seq)
            return False
        return True

    @staticmethod
    def rejected(row: ScheduledRow, accepted: int) -> None:
        """A spec row's commit: the drafts it did not accept were counted as computed at launch; take them
        back (unless the sequence was preempted since: it recomputes from 0)."""
        seq = row.seq
        if row.spec_k and row.epoch == seq.num_preemptions and not seq.finalized:
            seq.num_computed_tokens -= row.spec_k - accepted

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finalize now; pages go back only when no in-flight step still references the row."""
        seq.finish_reason = reason
        seq.finalized = True
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release_if_idle(seq)

    def release_if_idle(self, seq: Sequence) -> None:
        if not seq.finalized or seq.inflight_refs:
            return
        if seq.block_table:
            self.prefix.release(seq)
        self._give_rows_back(seq)

    def _take_rows(self, seq: Sequence) -> bool:
        """Every row the sequence needs, or none (a waiting sequence holds no rows)."""
        taken = []
        for pool in self.row_pools:
            held = getattr(seq, pool.field) >= 0
            if not pool.take(seq):
                for other in taken:
                    other.give_back(seq)
                return False
            if not held:
                taken.append(pool)
        return True

    def _give_rows_back(self, seq: Sequence) -> None:
        for pool in self.row_pools:
            pool.give_back(seq)
