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

With speculation the step's branch forks after its inputs are corrected (its drafts are known then): the
callback accepts the previous step's emitted tokens (1 + accepted drafts), then walks each row's drafts,
filling one mask per verified position, and rolls the walk back (engine/guided/matching.py). The drafts a
walk accepts cap what verification may accept, so a draft the grammar rejects is cut before it is verified.
The draft phase's own callbacks (engine/guided/draft_masks.py) run after it on the same stream.

Failures stay with their request: a token the grammar rejects or an exception while advancing or filling
a row sets that request's `error` (read at the commit of this step, after the callback ran) and leaves
its row unmasked; a failure of the callback as a whole is kept in `snapshot.failure` for every guided row.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque

import numpy as np
import torch
import xgrammar as xgr

import hostfunc
from engine.parallel.group import SINGLE
from engine.guided.matching import ALL, GuidedRow, accept_rows, walk_drafts


class Snapshot:
    __slots__ = ("slot", "prev", "step", "width", "rows", "unguided", "consumed", "failure", "times", "done")

    def __init__(self, slot: int, prev: int, rows: tuple, unguided: np.ndarray, step: int = 0, width: int = 1):
        self.slot, self.prev, self.rows, self.unguided = slot, prev, rows, unguided
        self.step = step            # the step's index (which step's device tokens a row's matcher accepted)
        self.width = width          # masks per sampling row: 1 + the drafts it verifies
        self.consumed = False       # its tokens were accepted (a reuse only refills the masks)
        self.failure = None         # message, if the callback failed as a whole
        self.times = None           # (start, end) perf_counter seconds of its callback
        self.done = threading.Event()   # set when its callback has run (the loop thread may wait on it)


EMPTY = Snapshot(0, 1, (), np.zeros(0, dtype=np.int64), step=-1)


def build_snapshot(slot_index: int, rows, step: int = 0, width: int = 1) -> Snapshot | None:
    """Before the step's rows are marked in flight: `seq.num_pending` still counts the previous step's
    tokens, emitted by step `step - 1` (the one in flight). None: no guided row."""
    guided, unguided = [], []
    for row in rows:
        if not row.sample:
            continue
        seq, g = row.seq, row.seq.guided
        if g is None:
            unguided.append(row.sample_idx)
            continue
        out, lo = seq.output_token_ids, g.accepted          # a lower bound of what it will have accepted
        pending = seq.pending_src if seq.num_pending else -1
        guided.append(GuidedRow(row.sample_idx, g, lo, tuple(out[lo:]), pending, step - 1))
    if not guided:
        return None
    return Snapshot(slot_index, 1 - slot_index, tuple(guided), np.asarray(unguided, dtype=np.int64), step, width)


class GrammarMasks:
    """Mask buffers of both slots. With speculation (k > 0) a sampling row has 1 + k mask rows (one per
    position it verifies), the previous step's tokens are its emitted ones ([rows, k + 2], PAD after them),
    and the step hands the callback its drafts and draft counts (`drafts_dev`, [rows, k + 1]) and gets back
    how many of them the grammar accepts (`caps_dev`)."""

    def __init__(self, vocab_size: int, max_seqs: int, device: torch.device, threads: int = 1, k: int = 0, tp=SINGLE):
        self.cuda = device.type == "cuda"
        self.tp = tp            # tensor parallelism: rank 0 fills the masks, `join` broadcasts them to the others
        self.k, self.words = k, -(-vocab_size // 32)
        pin = self.cuda

        def pair(shape, dtype, fill=0):
            return [torch.full(shape, fill, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.host = pair((max_seqs * (k + 1), self.words), torch.int32, -1)
        self.tokens_host = pair((max_seqs, k + 2 if k else 1), torch.int64)
        self.drafts_host, self.caps_host = pair((max_seqs, k + 1), torch.int64), pair((max_seqs,), torch.int64)
        self.dev, self.drafts_dev, self.caps_dev = ([h.to(device) if self.cuda else h for h in hs]
                                                    for hs in (self.host, self.drafts_host, self.caps_host))
        self.host_np, self.tokens_np, self.drafts_np, self.caps_np = ([h.numpy() for h in hs] for hs in (
            self.host, self.tokens_host, self.drafts_host, self.caps_host))
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

    @staticmethod
    def _emitted(prev) -> torch.Tensor:
        return prev.spec_out if prev.spec_out is not None else prev.sampled[:, None]

    def branch(self, slot, prev, rows: int, compute_stream, width: int = 1) -> None:
        """Enqueue the grammar branch of a step (eager or under capture); CUDA only. With drafts (width > 1)
        the step has written `drafts_dev` before this, on the compute stream. Only rank 0 runs it."""
        if not self.tp.decides:
            return
        i = slot.index
        self.fork[i].record(compute_stream)
        self.grammar_stream.wait_event(self.fork[i])
        with torch.cuda.stream(self.grammar_stream):
            self.tokens_host[prev.index].copy_(self._emitted(prev), non_blocking=True)
            if width > 1:
                self.drafts_host[i][:rows].copy_(self.drafts_dev[i][:rows], non_blocking=True)
            hostfunc.launch_hostfunc(self.grammar_stream, self.callback)
            self.dev[i][:rows * width].copy_(self.host[i][:rows * width], non_blocking=True)
            if width > 1:
                self.caps_dev[i][:rows].copy_(self.caps_host[i][:rows], non_blocking=True)
            self.mask_ready[i].record(self.grammar_stream)

    def join(self, slot, prev, rows: int, compute_stream, width: int = 1):
        """Before sampling: the compute stream waits for the masks (CUDA); the CPU runs the callback here.
        -> (masks [rows * width, words], the drafts the grammar accepts per row [rows]), rank 0's on every rank."""
        if self.tp.decides and self.cuda:
            compute_stream.wait_event(self.mask_ready[slot.index])
        elif self.tp.decides:
            self.tokens_host[prev.index].copy_(self._emitted(prev))
            self.run()
        masks, caps = self.dev[slot.index][:rows * width], self.caps_dev[slot.index][:rows]
        self.tp.broadcast(masks)
        if width > 1:
            self.tp.broadcast(caps)
        return masks, caps

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
        """Accept what the rows' matchers still lack, then fill each row's masks along its drafts (one mask
        when it has none); rows failed or ended keep all-allowed masks (their tokens are not committed)."""
        w, mask, caps = snap.width, self.host_np[snap.slot], self.caps_np[snap.slot]
        if len(snap.unguided):
            mask[(snap.unguided[:, None] * w + np.arange(w)[None, :]).ravel()] = ALL
            caps[snap.unguided] = self.k
        if accept:
            accept_rows(self.batch, snap.rows, self.tokens_np[snap.prev][:, :self.k + 1])
        drafts = self.drafts_np[snap.slot]
        walk_drafts(self.batch, self.host[snap.slot], snap.rows, w, drafts, drafts[:, self.k], caps)


def _call(ref) -> None:
    masks = ref()
    if masks is not None:
        masks.run()
