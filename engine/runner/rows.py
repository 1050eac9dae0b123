"""The one row writer: a scheduled row's step inputs in a slot's host buffers, for plain and speculative steps
(`fill_slot`: a step's rows, then the slot's counts).

A row covers positions [start, start + n) of its sequence. Its tokens are the host's where it knows them;
a sequence with a token in flight (`num_pending`) starts or ends at that token, which the device carries from
the sequence's token-pool row (carry_src 0), and a speculating row's K drafts follow it (carry_src 1..K):
[last token, draft 1, ..., draft K]. A plain row is a speculating row with K = 0. engine/speculative/plan.py adds
what only speculation reads (corrections for rejected drafts, the next token of each input, page caps);
engine/sampling/penalties.py what only penalized rows read (fill_extras).
"""
from __future__ import annotations

from engine.requests.validation import min_tokens_stops
from engine.runner import _rows, spec_rows
from engine.sampling import penalties
from engine.speculative import plan as spec_plan


# what a step's rows ask of it (row_flags): a sampling row wants logprobs, a row is penalized, a sampling row is not
# greedy, a sampling row is guided
ROW_LOGPROBS, ROW_PENALIZED, ROW_SAMPLED, ROW_GUIDED = 1, 2, 4, 8
# _fill_decode's fields, in the order of its tuples
DECODE_INPUTS = ("input_ids", "positions", "slot_mapping", "carry_src", "tok_row", "seq_lens")
DECODE_SAMPLING = ("logits_indices", "temperature", "top_k", "top_p", "seeds", "steps", "smp_row", "forced")
SHIFT_WINDOW = 16       # rows below a row searched for its table (write_block_table): finished requests a step


class RowError(Exception):
    """Preparing row `index` of a step failed: the engine fails that row's request alone."""

    def __init__(self, index: int, cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.index = index


def fill_slot(slot, rows, block_size: int, spec_k: int, penalty_state, eos_ids, uses_history: bool) -> None:
    """Fill the slot's host buffers for these rows. A row may end at the sequence's pending token (sampled by the
    in-flight step, unknown to the host): the device carries it from the token pool. uses_history: the drafter
    reads each sequence's tokens (n-gram), so an admission's cached prefix is written for it. Raises RowError
    naming the row whose inputs could not be written."""
    t, s, max_q, max_len, carries = _fill(slot, rows, block_size, spec_k)
    slot.np["cu_seqlens_q"][0] = 0
    slot.num_tokens, slot.num_seqs, slot.num_sample, slot.num_carry = t, len(rows), s, carries
    slot.spec_k = rows[0].spec_k if rows else 0
    slot.max_query_len, slot.max_seq_len, slot.rows = max_q, max_len, rows
    flags = row_flags(rows)
    slot.all_greedy, slot.guided_rows = not flags & ROW_SAMPLED, bool(flags & ROW_GUIDED)
    fill_extras(slot, rows, penalty_state, eos_ids, flags)
    slot.history_writes = [(r.seq.pool_row, r.seq.tokens(0, r.cached)) for r in rows if r.cached] \
        if spec_k and uses_history else []


def _fill(slot, rows, block_size: int, spec_k: int) -> tuple[int, int, int, int, int]:
    """-> (tokens, sampling rows, longest row, longest sequence, carrying rows). A plain step's leading one-token
    rows (decoding; admissions' prompt chunks come after them) are written in one native call (_fill_decode: even
    one row costs less there than its scalar writes here; a speculating engine's plain step adds its fields a
    column at a time), the rest row by row (_fill_rows)."""
    if rows and rows[0].spec_k:
        return _fill_spec(slot, rows, block_size)
    lead = _rows.leading_decode(rows)
    if not lead:
        return _fill_rows(slot, rows, block_size, spec_k)
    t, s, max_q, max_len, carries = _fill_decode(slot, rows[:lead], block_size, spec=bool(spec_k))
    if lead == len(rows):
        return t, s, max_q, max_len, carries
    t, s, rest_q, rest_len, rest_carries = _fill_rows(slot, rows, block_size, spec_k, lead, t, s)
    return t, s, max(max_q, rest_q), max(max_len, rest_len), carries + rest_carries


def _fill_rows(slot, rows, block_size: int, spec_k: int, first: int = 0, t: int = 0,
               s: int = 0) -> tuple[int, int, int, int, int]:
    """Rows from `first` (their tokens from t, sampling rows from s), one after another -> (tokens, sampling rows,
    and of these rows: longest row, longest sequence, carrying rows)."""
    max_q = max_len = carries = 0
    for i in range(first, len(rows)):
        row = rows[i]
        try:
            t, s = _fill_row(slot, i, row, t, s, block_size, spec_k)
        except Exception as exc:
            raise RowError(i, exc) from exc
        max_q, max_len = max(max_q, row.num_tokens), max(max_len, row.start + row.num_tokens)
        carries += bool(row.seq.num_pending or row.spec_k)
    return t, s, max_q, max_len, carries


def _fill_spec(slot, rows, block_size: int) -> tuple[int, int, int, int, int]:
    """A spec step's rows a field at a time (engine/runner/spec_rows.py); row by row where one is not a speculating
    decode row, which raises RowError naming a row it cannot write."""
    try:
        out = spec_rows.fill_spec_step(slot, rows, block_size)
    except ValueError:
        return _fill_rows(slot, rows, block_size, rows[0].spec_k)
    for i, row in enumerate(rows):
        write_block_table(slot, i, row.seq)
    return out


def _fill_decode(slot, rows, block_size: int, spec: bool = False) -> tuple[int, int, int, int, int]:
    """_fill_decode_py in native code (engine/runner/csrc/rows.cpp), with `spec` a speculating engine's fields too
    (spec_rows.fill_spec_decode); a row it cannot write is written again by the Python walks, which raise RowError
    naming it."""
    try:
        return _rows.fill_decode(rows, slot.np, slot.bt_rows, block_size, spec)
    except Exception:       # noqa: BLE001 - the Python walk names the row, or writes what native code refused
        out = _fill_decode_py(slot, rows, block_size)
        if spec:
            spec_rows.fill_spec_decode(slot, rows, block_size)
        return out


def _fill_decode_py(slot, rows, block_size: int) -> tuple[int, int, int, int, int]:
    """_fill_rows for a plain step whose rows are one token each (decoding): the same values, a tuple per row and
    per sampling row, written a field at a time, not ~14 scalar writes and three calls a row. Such a row's token
    is known to the host unless it is pending (then carried from the token pool), so every field is written."""
    h, bs = slot.np, block_size
    inputs, sampling = [], []
    for i, row in enumerate(rows):
        seq, start = row.seq, row.start
        pending = seq.num_pending
        try:
            _check_pool_row(seq, pending)
            inputs.append((0 if pending else seq.token_at(start), start, seq.block_table[start // bs] * bs + start % bs,
                           0 if pending else -1, seq.pool_row, start + 1))
            write_block_table(slot, i, seq)
        except Exception as exc:
            raise RowError(i, exc) from exc
        if row.sample:
            row.sample_idx, p = len(sampling), seq.params
            step = len(seq.output_token_ids) + pending
            sampling.append((i, p.temperature, p.top_k, p.top_p, seq.seed, step, seq.pool_row,
                             -1 if seq.closer is None else seq.closer.forced_at(step)))
    n, s = len(rows), len(sampling)
    columns = list(zip(*inputs)) if inputs else [()] * len(DECODE_INPUTS)
    for name, values in zip(DECODE_INPUTS, columns):
        h[name][:n] = values
    for name, values in zip(DECODE_SAMPLING, zip(*sampling) if sampling else ()):
        h[name][:s] = values
    h["cu_seqlens_q"][1:n + 1] = range(1, n + 1)
    fields = dict(zip(DECODE_INPUTS, columns))
    return n, s, 1 if n else 0, max(fields["seq_lens"], default=0), fields["carry_src"].count(0)


def _fill_row(slot, i: int, row, t: int, s: int, block_size: int, spec_k: int) -> tuple[int, int]:
    """Write row i (its tokens from t, its sampling row s); returns the next (t, s)."""
    seq, n, h = row.seq, row.num_tokens, slot.np
    _check_pool_row(seq, seq.num_pending or row.spec_k)
    _fill_tokens(h, row, t, block_size)
    if spec_k:
        spec_plan.fill_spec_row(slot, i, row, t, block_size)
    write_block_table(slot, i, seq)
    h["seq_lens"][i] = row.start + n
    h["cu_seqlens_q"][i + 1] = t + n
    if row.sample:
        row.sample_idx = s
        fill_sampling(h, s, t + n - 1, seq)
        if spec_k:
            spec_plan.fill_spec_sampling(slot, s, row, t)
        s += 1
    return t + n, s


def _check_pool_row(seq, carries) -> None:
    """A row whose tokens the device carries (a pending token, drafts) reads them from its token-pool row."""
    if carries and seq.pool_row < 0:
        raise RuntimeError("a sequence that carries tokens on the device holds no token-pool row")


def _fill_tokens(h, row, t: int, block_size: int) -> None:
    """fill_tokens in native code (engine/runner/csrc/rows.cpp); a row it refuses is written by fill_tokens, which
    raises naming why where it cannot."""
    try:
        _rows.fill_tokens(row, h, t, block_size)
    except Exception:       # noqa: BLE001 - the Python walk writes the row or raises what it raises
        fill_tokens(h, row, t, block_size)


def fill_tokens(h, row, t: int, block_size: int) -> None:
    """Row `row`'s tokens from index t of the step: positions, slot mapping, ids, pool rows, carry sources (the
    definition of _rows.fill_tokens)."""
    seq, n, start, k = row.seq, row.num_tokens, row.start, row.spec_k
    end, bt, bs = start + n, seq.block_table, block_size
    known = min(end, seq.num_tokens)
    h["positions"][t:t + n] = range(start, end)
    h["slot_mapping"][t:t + n] = [bt[p // bs] * bs + p % bs for p in range(start, end)]
    h["tok_row"][t:t + n] = seq.pool_row
    h["carry_src"][t:t + n] = -1
    if known > start:
        h["input_ids"][t:t + known - start] = seq.tokens(start, known)
    if k:                                           # [last token, K drafts]
        h["carry_src"][t + 1:t + n] = range(1, k + 1)
        h["input_ids"][t + 1:t + n] = 0
    if seq.num_pending:                             # its last token is still on the device
        last = t if k else t + n - 1
        h["input_ids"][last] = 0
        h["carry_src"][last] = 0


def fill_sampling(h, s: int, token_index: int, seq) -> None:
    """Sampling row s: the logits row it reads, its sampling parameters and the pool row it writes."""
    p = seq.params
    h["logits_indices"][s] = token_index
    h["temperature"][s] = p.temperature
    h["top_k"][s] = p.top_k
    h["top_p"][s] = p.top_p
    h["seeds"][s] = seq.seed
    h["steps"][s] = len(seq.output_token_ids) + seq.num_pending
    h["smp_row"][s] = seq.pool_row
    h["forced"][s] = -1 if seq.closer is None else seq.closer.forced_at(h["steps"][s])


def write_block_table(slot, i: int, seq) -> None:
    """Row i of the slot's block tables: only the pages it lacks if it last held this very table, or copied from
    the row up to SHIFT_WINDOW below that holds it (its sequence moved up as requests before it finished). Tables
    grow in place; preemption and release replace the list, so identity says the old pages are valid. slot.bt_rows
    names what every row holds at any time, so a row's copy source is valid whichever rows this step wrote."""
    bt = seq.block_table
    start = _held_pages(slot.bt_rows, i, bt)
    if start < 0:
        start = _copy_moved(slot, i, bt)
    if start < len(bt):
        slot.np["block_tables"][i, start:len(bt)] = bt[start:]
    slot.bt_rows[i] = (bt, len(bt))


def _held_pages(bt_rows, j: int, bt: list) -> int:
    """Pages of `bt` that row j holds (it last held this very list), or -1."""
    held, have = bt_rows[j]
    return have if held is bt and have <= len(bt) else -1


def _copy_moved(slot, i: int, bt: list) -> int:
    """Copy into row i the pages of `bt` that the first row of the SHIFT_WINDOW below it holds; how many (0: no
    row holds it)."""
    tables = slot.np["block_tables"]
    for j in range(i + 1, min(len(slot.bt_rows), i + 1 + SHIFT_WINDOW)):
        have = _held_pages(slot.bt_rows, j, bt)
        if have >= 0:
            tables[i, :have] = tables[j, :have]
            return have
    return 0


def row_flags(rows) -> int:
    """The ROW_* bits of a step's rows, in one native call (engine/runner/csrc/rows.cpp); row_flags_py where it
    cannot read a row."""
    try:
        return _rows.row_flags(rows)
    except Exception:       # noqa: BLE001 - the Python walk raises what it raises, or reads what native code refused
        return row_flags_py(rows)


def row_flags_py(rows) -> int:
    flags = 0
    for row in rows:
        p = row.seq.params
        flags |= ROW_PENALIZED if p.penalized else 0
        if row.sample:
            flags |= (ROW_LOGPROBS if p.logprobs is not None else 0) | (ROW_SAMPLED if p.temperature != 0 else 0) \
                | (ROW_GUIDED if row.seq.guided is not None else 0)
    return flags


def fill_extras(slot, rows, penalty_state, eos_ids, flags: int) -> None:
    """Whether the step runs its extras variant (logprobs, penalties), and the penalty inputs if so (penalty_state:
    the engine's PenaltyState, None without penalties; eos_ids: what min_tokens masks besides stop ids; flags: the
    rows' ROW_* bits)."""
    slot.want_logprobs = slot.logprobs is not None and bool(flags & ROW_LOGPROBS)
    penalized = penalty_state is not None and bool(flags & ROW_PENALIZED)
    slot.extras = slot.want_logprobs or penalized
    slot.bias_writes, slot.span_writes = [], []
    if not slot.extras or penalty_state is None:
        return
    h = slot.np
    for i, row in enumerate(rows):
        seq = row.seq
        first = row.start == row.cached         # an admission: position 0, or the end of its cached prefix
        h["pen_reset"][i] = seq.pen_row if first and not row.cached else -1
        if first and seq.pen_row >= 0:          # a new owner: its bias replaces the last one's
            slot.bias_writes.append((seq.pen_row, seq.params.logit_bias))
            if row.cached:                      # the cached span's counts, which no step of its own sees
                slot.span_writes.append((seq.pen_row, *penalties.span(seq, row.cached)))
        penalties.fill_tokens(h, row, int(h["cu_seqlens_q"][i]))
        if row.sample:
            stops = min_tokens_stops(seq.params, eos_ids) if seq.params.min_tokens else ()
            penalties.fill_sampling(h, row.sample_idx, seq, stops)
