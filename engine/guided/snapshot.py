"""A step's guided rows as the grammar node takes them (engine/guided/masks.py pushes them).

The loop thread builds one `Snapshot` a step from the step's sampling rows before they are marked in flight: which
rows are guided, their GuidedRequests, the output tokens each matcher still has to accept, and where the token of
the step in flight lies. It holds plain lists, so that no tuple a row is made unless the Python path asks for
`rows`; `bind` hands the grammar node its plain-data copy, each row named by its request's registry entry.
"""
from __future__ import annotations

import itertools

import numpy as np

from engine.guided import native
from engine.guided.matching import GuidedRow

_ids = itertools.count(1)   # snapshot ids (loop thread only; 0 is the node's empty first snapshot)


class Snapshot:
    """A step's guided rows. Bound to the grammar node's plain-data copy when pushed (`native`)."""
    __slots__ = ("id", "slot", "prev", "step", "width", "_rows", "_columns", "unguided", "native", "owner")

    def __init__(self, slot: int, prev: int, rows: tuple, unguided: np.ndarray, step: int = 0, width: int = 1,
                 columns: tuple | None = None):
        """rows: GuidedRows; or () and `columns`, the same rows as seven lists (`columns()`; build_snapshot's: no tuple
        a row is made unless the Python path asks for `rows`)."""
        self._rows, self._columns = rows, columns
        self.id = next(_ids) if rows or (columns and columns[0]) else 0
        self.slot, self.prev, self.unguided = slot, prev, unguided
        self.step = step            # the step's index (which step's device tokens a row's matcher accepted)
        self.width = width          # masks per sampling row: 1 + the drafts it verifies
        self.native = None
        self.owner = None           # the hostfunc owner of the masks it was pushed to (their callbacks' errors)

    @property
    def done(self) -> "_Done":
        """Set when its callback has run. Made on each read: a snapshot that held its own _Done would be a
        reference cycle, keeping its rows' requests and matchers alive until the garbage collector ran."""
        return _Done(self)

    @property
    def rows(self) -> tuple:
        if not self._rows and self._columns:
            row, requests, starts, offsets, feed, sources, steps = self._columns
            self._rows = tuple(GuidedRow(r, g, start, tuple(feed[offsets[i]:offsets[i + 1]]), src, step)
                               for i, (r, g, start, src, step) in enumerate(zip(row, requests, starts, sources, steps)))
        return self._rows

    def columns(self) -> tuple:
        """The rows as seven lists: row, request, feed_start, feed offsets (one more than rows), the host-known
        tokens of every row one after another (row i's: feed[offsets[i]:offsets[i + 1]]), pending_src,
        pending_step."""
        if self._columns is None:
            offsets, feed = [0], []
            for r in self._rows:
                feed += r.feed
                offsets.append(len(feed))
            fields = tuple(map(list, zip(*self._rows))) if self._rows else ([],) * 6
            self._columns = fields[:3] + (offsets, feed) + fields[4:]
        return self._columns

    def bind(self, registry, python: bool) -> None:
        """Its copy for the grammar node, each row named by its request's registry entry (GuidedRequest.entry)."""
        row, requests, starts, offsets, feed, sources, steps = self.columns()
        entries = native.registry_entries(registry, requests)      # [g.entry(registry) for g in requests]
        self.native = native.NativeSnapshot(registry, self.id, self.slot, self.prev, self.step, self.width, python,
                                            row, entries, starts, offsets, feed, sources, steps,
                                            self.unguided.tolist())

    @property
    def consumed(self) -> bool:
        """Its tokens were accepted (a reuse only refills the masks)."""
        return self.native is not None and self.native.consumed

    @property
    def failure(self) -> str | None:
        """Message, if the callback failed as a whole."""
        return self.native.failure if self.native is not None else None

    @failure.setter
    def failure(self, message: str | None) -> None:
        self.native.failure = message

    @property
    def times(self):
        """(start, end) perf_counter seconds of its callback, or None."""
        return self.native.times if self.native is not None else None


class _Done:
    __slots__ = ("snap",)

    def __init__(self, snap):
        self.snap = snap

    def is_set(self) -> bool:
        return self.snap.native is not None and self.snap.native.is_done()

    def wait(self, timeout: float) -> bool:
        return self.snap.native is not None and self.snap.native.wait(timeout)


EMPTY = Snapshot(0, 1, (), np.zeros(0, dtype=np.int64), step=-1)


def guided_columns(rows) -> tuple:
    """A step's sampling rows as build_snapshot reads them, one list a field: the guided rows' sample indices,
    GuidedRequests, accepted counts (a lower bound of what each will have accepted), feed offsets, feed (the
    output tokens from there), the sample index of each one's token in flight (-1: none); then the unguided rows'
    sample indices. One pass. The host path's native walk (engine/requests/csrc/guided_walk.cpp) does the same."""
    sample, requests, starts, offsets, feed, sources, unguided = [], [], [], [0], [], [], []
    for row in rows:
        if not row.sample:
            continue
        seq = row.seq
        g = seq.guided
        if g is None:
            unguided.append(row.sample_idx)
            continue
        lo = g.accepted
        sample.append(row.sample_idx)
        requests.append(g)
        starts.append(lo)
        out = seq.output_token_ids
        if lo < len(out):
            feed += out[lo:]
        offsets.append(len(feed))
        sources.append(seq.pending_src if seq.num_pending else -1)
    return sample, requests, starts, offsets, feed, sources, unguided


def build_snapshot(slot_index: int, rows, step: int = 0, width: int = 1, walk=guided_columns) -> Snapshot | None:
    """Before the step's rows are marked in flight: `seq.num_pending` still counts the previous step's
    tokens, emitted by step `step - 1` (the one in flight). None: no guided row. `walk`: guided_columns or a
    native walk equal to it."""
    sample, requests, starts, offsets, feed, sources, unguided = walk(rows)
    if not requests:
        return None
    return Snapshot(slot_index, 1 - slot_index, (), np.asarray(unguided, dtype=np.int64), step, width,
                    (sample, requests, starts, offsets, feed, sources, [step - 1] * len(requests)))
