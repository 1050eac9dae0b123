"""A speculating engine's step inputs written a field at a time: what rows.py's row-by-row writer (with
engine/speculative/plan.py's fill_spec_row and fill_spec_sampling, their definition) writes for the two kinds of
step that are all decode rows, gathered one tuple a row. Tests hold the two equal (tests/runner/test_rows.py).

- `fill_spec_decode`: a plain step's leading one-token rows, after their tokens and sampling fields: only
  speculation's own fields. The native decode writer writes the same fields in its walk (rows.cpp, spec=True);
  this is their definition, and what writes them where the native writer refuses a row.
- `fill_spec_step`: a spec step, every row its sequence's last token and K drafts (1 + K tokens), all sampling.
  Block tables are the caller's (rows.py write_block_table).
"""
from __future__ import annotations

import numpy as np

_SAMPLING = ("temperature", "top_k", "top_p", "seeds", "steps", "smp_row", "forced", "smp_shift", "num_drafts")


def fill_spec_decode(slot, rows, block_size: int) -> None:
    """Speculation's fields of a plain step's leading one-token rows (row i is token i)."""
    n = len(rows)
    if not n:
        return
    h, cols = slot.np, []
    for row in rows:
        seq = row.seq
        pending = seq.num_pending > 0
        cols.append((pending, seq.pool_row if pending else -1, len(seq.block_table) * block_size,
                     row.sample_idx if row.sample else -1))
    pending, seq_shift, kv_cap, smp = (np.array(c, dtype=np.int64) for c in zip(*cols))
    h["tok_seq"][:n] = np.arange(n)
    h["shift"][:n] = pending
    h["seq_shift"][:n] = seq_shift
    h["kv_cap"][:n] = kv_cap
    sampled = smp >= 0
    h["smp_shift"][smp[sampled]] = pending[sampled]
    h["num_drafts"][smp[sampled]] = 0
    h["next_ids"][:n] = np.where(sampled, -2 - smp, -1)    # the token a sampling row emits; else the host's, if known
    for i in np.flatnonzero(~sampled).tolist():
        seq, start = rows[i].seq, rows[i].start
        if start + 1 < seq.num_tokens:
            h["next_ids"][i] = seq.token_at(start + 1)


def fill_spec_step(slot, rows, block_size: int) -> tuple[int, int, int, int, int]:
    """A spec step's rows -> (tokens, sampling rows, longest row, longest sequence, carrying rows), as rows.py
    _fill_rows returns them. Raises ValueError at a row that is not its sequence's last token and K drafts (the
    caller then writes row by row, which names a row it cannot write)."""
    n, k, bs = len(rows), rows[0].spec_k, block_size
    w = k + 1
    if k <= 0:
        raise ValueError(f"a spec step's rows hold drafts, got K = {k}")
    span = k // bs + 2                                  # pages a row's 1 + K tokens may touch
    h, cols, sampling, pages = slot.np, [], [], []
    for i, row in enumerate(rows):
        seq, start = row.seq, row.start
        pending, bt, known = seq.num_pending, seq.block_table, seq.num_tokens
        if row.num_tokens != w or row.spec_k != k or not row.sample or seq.pool_row < 0 or known > start + 1:
            raise ValueError(f"row {i} is not a speculating decode row")
        first, last = start // bs, (start + k) // bs
        if last >= len(bt):
            raise ValueError(f"row {i} lacks the page of its last draft")
        row_pages = bt[first:first + span]
        pages += row_pages if len(row_pages) == span else row_pages + [0] * (span - len(row_pages))
        cols.append((start, 0 if pending or known <= start else seq.token_at(start), seq.pool_row, pending > 0,
                     len(bt) * bs))
        row.sample_idx, p = i, seq.params
        step = len(seq.output_token_ids) + pending
        sampling.append((p.temperature, p.top_k, p.top_p, seq.seed, step, seq.pool_row,
                         -1 if seq.closer is None else seq.closer.forced_at(step), pending > 0, row.num_drafts))
    start, token, pool, pending, kv_cap = (np.array(c, dtype=np.int64) for c in zip(*cols))
    j = np.arange(w)
    pos = start[:, None] + j                                    # [rows, 1 + K]
    page = np.array(pages, dtype=np.int64)[pos // bs - (start // bs - np.arange(0, n * span, span))[:, None]]
    t = n * w
    h["positions"][:t] = pos.ravel()
    h["slot_mapping"][:t] = (page * bs + pos % bs).ravel()
    h["tok_row"][:t] = np.repeat(pool, w)
    h["carry_src"][:t] = np.where(j == 0, np.where(pending, 0, -1)[:, None], j).ravel()
    h["input_ids"][:t] = np.where(j == 0, token[:, None], 0).ravel()
    h["tok_seq"][:t] = np.repeat(np.arange(n), w)
    h["shift"][:t] = np.repeat(pending, w)
    h["next_ids"][:t] = -2 - np.arange(t)                      # each input's next token: the one it verifies
    rows_at = np.arange(n)
    h["seq_lens"][:n] = start + w
    h["cu_seqlens_q"][1:n + 1] = (rows_at + 1) * w
    h["seq_shift"][:n] = np.where(pending, pool, -1)
    h["kv_cap"][:n] = kv_cap
    h["logits_indices"][:n] = rows_at * w
    for name, values in zip(_SAMPLING, zip(*sampling)):
        h[name][:n] = values
    return t, n, w, int(start.max()) + w, n
