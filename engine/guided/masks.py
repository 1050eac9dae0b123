"""Token masks of guided rows, filled by one host node per step on the grammar stream.

Per step the loop thread pushes a `Snapshot` (which sampling rows are guided, their GuidedRequests, the
host-known tokens each matcher still has to accept, and where the token sampled by the previous step
lies) to the grammar node (engine/guided/csrc/), as plain data: row indices, each request's registry entry
(its state and matcher handle, registered once), token counts. The node pops it when the step's graph replays
it: native code calling xgrammar through tvm-ffi, with no Python and no GIL. It reads nothing else of the
engine's mutable state.

On CUDA the step's grammar branch is, in stream order on `grammar_stream` (forked from the compute stream
at the step's start, so the previous step's tokens are final on the device):

    previous step's tokens -> pinned host  |  callback: accept them, fill this step's bitmask rows (pinned)
    |  bitmask -> device  |  record `mask_ready`

It runs beside the forward; only the sampling waits for `mask_ready`. A graph captures the branch with the
node as a host node, so a replay pops the snapshot pushed for it. The CPU runs the same node inline, in the
same order, before sampling. A popped-empty queue (warm-up, capture) reuses the last snapshot
without accepting anything again, so such runs are harmless.

With speculation the step's branch forks after its inputs are corrected (its drafts are known then): the
callback accepts the previous step's emitted tokens (1 + accepted drafts), then walks each row's drafts,
filling one mask per verified position, and rolls the walk back (engine/guided/matching.py). The drafts a
walk accepts cap what verification may accept, so a draft the grammar rejects is cut before it is verified.
The draft phase's own callbacks (engine/guided/draft_masks.py) run after it on the same stream.

Failures stay with their request: a token the grammar rejects or an exception while advancing or filling
a row sets that request's `error` (read at the commit of this step, after the callback ran) and leaves
its row unmasked; a failure of the callback as a whole is kept in `snapshot.failure` for every guided row.

The Python path (engine/guided/matching.py) does the same steps through xgrammar's Python API. A step runs
it when one of its rows has a matcher that is not xgrammar's own (a wrapper, as failure tests use), or
when the engine asks for it (`Tuning.grammar_node="python"`: the reference the native node is tested
and measured against); the node then calls it through hostfunc's trampoline, which takes the GIL.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
import torch
import xgrammar as xgr

import hostfunc
from engine.guided import native
from engine.guided.matching import ALL, accept_rows, walk_drafts, walk_tree
from engine.guided.snapshot import EMPTY, Snapshot
from engine.parallel.group import SINGLE

MIN_PARALLEL_ROWS = 8       # fewer guided rows fill on one thread: waking workers costs more than they save


class GrammarMasks:
    """Mask buffers of both slots. With speculation (k > 0) a sampling row has 1 + k mask rows (one per
    position it verifies), the previous step's tokens are its emitted ones ([rows, k + 2], PAD after them),
    and the step hands the callback its drafts and draft counts (`drafts_dev`, [rows, k + 1]) and gets back
    how many of them the grammar accepts (`caps_dev`; a tree step's: the deepest depth a draft may be accepted at,
    matching.py walk_tree). `python`: every step takes the Python path."""

    def __init__(self, vocab_size: int, max_seqs: int, device: torch.device, threads: int = 1, k: int = 0, tp=SINGLE,
                 python: bool = False, tree=None):
        self.cuda = device.type == "cuda"
        self.tp = tp            # tensor parallelism: rank 0 fills the masks, `join` broadcasts them to the others
        self.k, self.words, self.python = k, -(-vocab_size // 32), python
        self.tree = tree        # a tree engine's DraftTree (k its drafts): steps of width k + 1 walk it
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
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)     # the Python path's
        self.pending: OrderedDict[int, Snapshot] = OrderedDict()   # pushed, by id; pruned once the node passed them
        self._last = EMPTY
        self.matchers = native.matchers()
        self.registry = native.Registry(self.matchers)     # guided requests' native handles, once per request
        self.node = native.Node(self.matchers, threads, MIN_PARALLEL_ROWS)
        ptrs = lambda hs: [h.data_ptr() for h in hs]        # noqa: E731
        self.node.set_target(ptrs(self.host), max_seqs * (k + 1), self.words, ptrs(self.tokens_host),
                             self.tokens_host[0].shape[1], ptrs(self.drafts_host), ptrs(self.caps_host), k)
        if tree is not None:
            if tree.nodes != k:
                raise ValueError(f"a draft tree of {tree.nodes} drafts needs masks of k = {tree.nodes}, got k = {k}")
            self.node.set_tree(tree.depth, [d for d, _ in tree.leaves])
        ref = weakref.ref(self)         # standing entries and graphs keep the node, not the masks, alive
        self.owner = hostfunc.new_owner()   # tags this engine's callbacks: their errors are its alone
        with hostfunc.owner_scope(self.owner):
            self.standing = [hostfunc.standing_callback(_run_python, ref)[0]]
        self.node.set_python(hostfunc._C.trampoline_address(), self.standing[0], [])
        weakref.finalize(self, _close, self.node, self.standing)
        if self.cuda:
            self.grammar_stream = torch.cuda.Stream(device)
            self.fork = [torch.cuda.Event() for _ in range(2)]
            self.mask_ready = [torch.cuda.Event() for _ in range(2)]

    def attach_draft_python(self, handles: list[int]) -> None:
        """The Python path's draft callbacks (engine/guided/draft_masks.py), for steps that take it."""
        self.standing += handles
        self.node.set_python(hostfunc._C.trampoline_address(), self.standing[0], handles)

    # ---- loop thread -------------------------------------------------------------------------
    def push(self, snapshot: Snapshot) -> None:
        snapshot.bind(self.registry, self.python)
        snapshot.owner = self.owner
        last = self.node.last_id() or 0
        while self.pending and next(iter(self.pending)) < last:
            self.pending.popitem(last=False)
        self.pending[snapshot.id] = snapshot
        self.node.push(snapshot.native)

    def unpush(self, snapshot: Snapshot) -> None:
        """The step's launch failed before its node was enqueued: take its snapshot back."""
        self.node.unpush(snapshot.id)
        self.pending.pop(snapshot.id, None)

    @property
    def queue(self) -> int:
        """Snapshots pushed and not yet taken by a node run."""
        return self.node.queued()

    @property
    def last(self) -> Snapshot:
        """The snapshot of the node's latest run (a Python draft callback's step)."""
        snap = self.pending.get(self.node.last_id() or 0)
        if snap is not None:
            self._last = snap
        return self._last

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
            hostfunc.launch_native(self.grammar_stream, native.TARGET_NODE, self.node.address)
            self.dev[i][:rows * width].copy_(self.host[i][:rows * width], non_blocking=True)
            if width > 1:
                self.caps_dev[i][:rows].copy_(self.caps_host[i][:rows], non_blocking=True)
            self.mask_ready[i].record(self.grammar_stream)

    def join(self, slot, prev, rows: int, compute_stream, width: int = 1):
        """Before sampling: the compute stream waits for the masks (CUDA); the CPU runs the node here.
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

    def run(self) -> None:
        """Run the step's node here (the CPU's path; tests), GIL released."""
        self.node.run()

    # ---- the Python path (the node calls it with the GIL, on the driver thread on CUDA) ----------
    def run_python(self) -> None:
        snap = self.last
        try:
            self._fill(snap, accept=not snap.consumed)
        except Exception as exc:            # noqa: BLE001 - every guided row of the step fails with it
            snap.failure = f"{type(exc).__name__}: {exc}"

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
        if self.tree is not None and w == self.k + 1:
            walk_tree(self.batch, self.host[snap.slot], snap.rows, w, drafts, drafts[:, self.k], caps, self.tree)
        else:
            walk_drafts(self.batch, self.host[snap.slot], snap.rows, w, drafts, drafts[:, self.k], caps)


def _run_python(ref) -> None:
    masks = ref()
    if masks is not None:
        masks.run_python()


def _close(node, standing) -> None:
    """The masks are going: the node stops (graphs that captured it then run nothing) and lets go of its
    snapshots; the Python path's entries are freed."""
    node.close()
    for handle in standing:
        try:
            hostfunc.free_hostfunc_user_data(handle)
        except (KeyError, hostfunc.HostfuncError):
            pass
