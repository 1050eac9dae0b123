"""Token masks of guided rows, filled by one host callback per step on the grammar stream.

Per step the loop thread pushes a `Snapshot` (which sampling rows are guided, their GuidedRequests, the
host-known tokens each matcher still has to accept, and where the token sampled by the previous step
lies); the step's callback pops it. The callback reads nothing else of the engine's mutable state.

On CUDA the step's grammar branch is, in stream order on `grammar_stream` (forked from the compute stream
at the step's start, so the previous step's tokens are final on the device):

    previous step's tokens -> pinned host  |  callback: accept them, fill this step's bitmask rows (pinned)
    |  bitmask -> device  |  record `mask_ready`

It runs beside the forward; only the sampling waits for `mask_ready`. A graph captures the branch with the
callback as a host node, so a replay pops the snapshot pushed for it. The CPU runs the same callback inline,
in the same order, before sampling. A popped-empty queue (warm-up, capture) reuses the last snapshot
without accepting anything again, so such runs are harmless.

Failures stay with their request: a token the grammar rejects or an exception while advancing or filling
a row sets that request's `error` (read at the commit of this step, after the callback ran) and leaves
its row unmasked; a failure of the callback as a whole is kept in `snapshot.failure` for every guided row.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import NamedTuple

import numpy as np
import torch
import xgrammar as xgr

import hostfunc


class GuidedRow(NamedTuple):
    row: int                    # sampling row of the step (its bitmask row)
    request: object             # GuidedRequest
    feed: tuple                 # output tokens the host knows and the matcher has not accepted
    pending_src: int            # row of the previous step's sampled tokens to accept after them (-1: none)


class Snapshot:
    __slots__ = ("slot", "prev", "rows", "unguided", "consumed", "failure", "times", "done")

    def __init__(self, slot: int, prev: int, rows: tuple, unguided: np.ndarray):
        self.slot, self.prev, self.rows, self.unguided = slot, prev, rows, unguided
        self.consumed = False       # its tokens were accepted (a reuse only refills the masks)
        self.failure = None         # message, if the callback failed as a whole
        self.times = None           # (start, end) perf_counter seconds of its callback
        self.done = threading.Event()   # set when its callback has run (the loop thread may wait on it)


EMPTY = Snapshot(0, 1, (), np.zeros(0, dtype=np.int64))


def build_snapshot(slot_index: int, rows) -> Snapshot | None:
    """Before the step's rows are marked in flight: `seq.num_pending` still counts the previous step's token.
    Advances each guided request's `fed` by what this snapshot will accept. None: no guided row."""
    guided, unguided = [], []
    for row in rows:
        if not row.sample:
            continue
        seq, g = row.seq, row.seq.guided
        if g is None:
            unguided.append(row.sample_idx)
            continue
        out = seq.output_token_ids
        pending = seq.pending_src if seq.num_pending else -1
        guided.append(GuidedRow(row.sample_idx, g, tuple(out[g.fed:]), pending))
        g.fed = len(out) + (pending >= 0)
    if not guided:
        return None
    return Snapshot(slot_index, 1 - slot_index, tuple(guided), np.asarray(unguided, dtype=np.int64))


def _failed(exc: Exception) -> str:
    return f"guided decoding failed: {type(exc).__name__}: {exc}"


def _advance(g, tokens) -> str | None:
    """Feed `tokens` to the request's matcher one by one: the request's error message, or None."""
    try:
        for tok in tokens:
            tok = int(tok)
            if tok < 0:
                return "no token was allowed here (the request's token mask was empty)"
            if g.matcher.is_terminated():
                return None                             # ended with its stop token: nothing more to accept
            if not g.matcher.accept_token(tok):
                return f"the grammar rejected token {tok}"
    except Exception as exc:                # noqa: BLE001 - this request alone fails
        return _failed(exc)
    return None


class GrammarMasks:
    def __init__(self, vocab_size: int, max_seqs: int, device: torch.device, threads: int = 1):
        self.cuda = device.type == "cuda"
        words = -(-vocab_size // 32)
        self.host = [torch.full((max_seqs, words), -1, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self.dev = [h.to(device) if self.cuda else h for h in self.host]
        self.tokens_host = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.tokens_np = [t.numpy() for t in self.tokens_host]
        self.queue: deque[Snapshot] = deque()
        self.last = EMPTY
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        if self.cuda:
            self.grammar_stream = torch.cuda.Stream(device)
            self.fork = [torch.cuda.Event() for _ in range(2)]
            self.mask_ready = [torch.cuda.Event() for _ in range(2)]
            ref = weakref.ref(self)         # captured graphs keep the callback, not the masks, alive
            self.callback = lambda: _call(ref)

    # ---- loop thread -------------------------------------------------------------------------
    def push(self, snapshot: Snapshot) -> None:
        self.queue.append(snapshot)

    def unpush(self, snapshot: Snapshot) -> None:
        """The step's launch failed before its callback was enqueued: take its snapshot back."""
        try:
            self.queue.remove(snapshot)
        except ValueError:
            pass

    def branch(self, slot, prev, rows: int, compute_stream) -> None:
        """Enqueue the grammar branch of a step (eager or under capture); CUDA only."""
        i = slot.index
        self.fork[i].record(compute_stream)
        self.grammar_stream.wait_event(self.fork[i])
        with torch.cuda.stream(self.grammar_stream):
            self.tokens_host[prev.index].copy_(prev.sampled, non_blocking=True)
            hostfunc.launch_hostfunc(self.grammar_stream, self.callback)
            self.dev[i][:rows].copy_(self.host[i][:rows], non_blocking=True)
            self.mask_ready[i].record(self.grammar_stream)

    def join(self, slot, prev, rows: int, compute_stream) -> torch.Tensor:
        """Before sampling: the compute stream waits for the mask (CUDA); the CPU runs the callback here."""
        if self.cuda:
            compute_stream.wait_event(self.mask_ready[slot.index])
        else:
            self.tokens_host[prev.index].copy_(prev.sampled)
            self.run()
        return self.dev[slot.index][:rows]

    # ---- callback (driver thread on CUDA) ------------------------------------------------------
    def run(self) -> None:
        snap = self.queue.popleft() if self.queue else self.last
        self.last = snap
        start = time.perf_counter()
        try:
            self._fill(snap, accept=not snap.consumed)
        except Exception as exc:            # noqa: BLE001 - every guided row of the step fails with it
            snap.failure = f"{type(exc).__name__}: {exc}"
        snap.consumed = True
        snap.times = (start, time.perf_counter())
        snap.done.set()

    def _fill(self, snap: Snapshot, accept: bool) -> None:
        mask = self.host_np[snap.slot]
        if len(snap.unguided):
            mask[snap.unguided] = -1
        if accept:
            self._accept(snap, self.tokens_np[snap.prev])
        matchers, rows = [], []
        for r in snap.rows:
            g = r.request
            try:
                if g.error is None and not g.matcher.is_terminated():
                    matchers.append(g.matcher)
                    rows.append(r.row)
                    continue
            except Exception as exc:        # noqa: BLE001 - this request alone fails
                g.error = _failed(exc)
            mask[r.row] = -1                # failed or ended: its token is not committed; keep the row samplable
        if matchers:
            self._fill_rows(snap, matchers, rows)

    def _accept(self, snap: Snapshot, prev: np.ndarray) -> None:
        """Each row's host-known tokens one by one (rare), then every row's previous sampled token in one
        batched call: the callback holds the GIL for one C++ call, not one per row."""
        requests, tokens = [], []
        for r in snap.rows:
            g = r.request
            if g.error is not None:
                continue
            if r.feed:
                g.error = _advance(g, r.feed)
            if g.error is None and r.pending_src >= 0:
                tok = int(prev[r.pending_src])
                if tok < 0 or type(g.matcher) is not xgr.GrammarMatcher:    # a wrapper: its own accept_token
                    g.error = _advance(g, (tok,))
                else:
                    requests.append(g)
                    tokens.append(tok)
        if not requests:
            return
        try:
            accepted = self.batch.batch_accept_token([g.matcher for g in requests], tokens)
        except Exception:                   # noqa: BLE001 - find the row(s) that fail, one by one
            for g, tok in zip(requests, tokens):
                g.error = _advance(g, (tok,))
            return
        for g, tok, ok in zip(requests, tokens, accepted):
            if not ok and not g.matcher.is_terminated():    # a terminated matcher ignores what follows its end
                g.error = f"the grammar rejected token {tok}"

    def _fill_rows(self, snap: Snapshot, matchers, rows) -> None:
        try:
            self.batch.batch_fill_next_token_bitmask(matchers, self.host[snap.slot], rows)
            return
        except Exception:                   # noqa: BLE001 - find the row(s) that fail, one by one
            pass
        mask = self.host_np[snap.slot]
        for r in snap.rows:
            if r.row in rows:
                try:
                    r.request.matcher.fill_next_token_bitmask(self.host[snap.slot], r.row)
                except Exception as exc:    # noqa: BLE001
                    r.request.error = _failed(exc)
                    mask[r.row] = -1


def _call(ref) -> None:
    masks = ref()
    if masks is not None:
        masks.run()
