"""engine/runner/rows.py's token writer against the per-token definition of its fields, and its decode steps' writer
against the row-by-row one."""
import random
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from engine.runner import rows as rows_mod
from engine.runner.graphs import pad_rows
from engine.runner.rows import fill_tokens
from engine.runner.slots import DecodeSlot
from engine.requests.sequence import SamplingParams, Sequence
from engine.scheduler import ScheduledRow

FIELDS = ("positions", "slot_mapping", "tok_row", "carry_src", "input_ids")
SAMPLING = ("logits_indices", "temperature", "top_k", "top_p", "seeds", "steps", "smp_row", "forced")


def _reference(row, block_size: int) -> dict:
    """Each field position by position: a token's slot is its page's id times the page size plus its offset."""
    seq, bt = row.seq, row.seq.block_table
    span = range(row.start, row.start + row.num_tokens)
    known = min(row.start + row.num_tokens, seq.num_tokens)
    carry = [-1] * row.num_tokens
    if seq.num_pending:                 # the last token is still on the device: carried from the pool row
        carry[-1] = 0
    return dict(positions=list(span), slot_mapping=[bt[p // block_size] * block_size + p % block_size for p in span],
                tok_row=[seq.pool_row] * row.num_tokens, carry_src=carry,
                input_ids=[seq.token_at(p) if p < known else 0 for p in span])


def _native_fill_tokens(h, row, t, block_size):
    rows_mod._rows.fill_tokens(row, h, t, block_size)


def _row_of(real: bool, tokens: list, n: int, start: int, pending: int, table: list, pool_row: int, k: int = 0):
    """A row of n tokens from `start`: an engine Sequence and ScheduledRow (the native writer reads their token
    lists), or stand-ins answering token_at."""
    if real:
        split = min(len(tokens), max(1, start))         # prompt and output both hold some of the row's tokens
        seq = Sequence(0, tokens[:split], SamplingParams(), 0, output_token_ids=tokens[split:], block_table=table,
                       num_pending=pending, pool_row=pool_row)
        return ScheduledRow(seq, start, n, True, spec_k=k)
    seq = NS(closer=None, block_table=table, num_tokens=len(tokens), pool_row=pool_row, num_pending=pending,
             token_at=tokens.__getitem__, tokens=lambda a, b, tokens=tokens: tokens[a:b])
    return NS(seq=seq, num_tokens=n, start=start, spec_k=k)


@pytest.mark.parametrize("real", [False, True])
@pytest.mark.parametrize("writer", [fill_tokens, _native_fill_tokens], ids=["python", "native"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_rows_of_any_length_and_start_write_every_token_as_defined(block_size, writer, real):
    rng = random.Random(block_size)
    for _ in range(200):
        n, start = rng.choice([1, 2, 5, 16, 17, 300]), rng.randrange(0, 400)
        pending = rng.choice([0, 0, 1])                    # the last token may still be in flight
        tokens = [rng.randrange(50000) for _ in range(start + n - pending)]
        table = rng.sample(range(10000), (start + n + block_size - 1) // block_size)
        row = _row_of(real, tokens, n, start, pending, table, rng.randrange(64))
        t = rng.randrange(0, 64)
        h = {k: np.zeros(t + n + 8, dtype=np.int64) for k in FIELDS}
        writer(h, row, t, block_size)
        want = _reference(row, block_size)
        for k in FIELDS:
            assert h[k][t:t + n].tolist() == want[k], (k, n, start)
            assert not h[k][:t].any() and not h[k][t + n:].any(), k     # nothing outside the row's tokens


@pytest.mark.parametrize("real", [False, True])
def test_the_native_token_writer_writes_speculating_rows_as_the_python_one(real):
    """A verification row [last token, K drafts] (the drafts carried from the token pool, the last token too where
    it is pending), native code against fill_tokens, its definition; a row it cannot write is refused."""
    rng = random.Random(3)
    for _ in range(100):
        k, start, pending = rng.randrange(1, 5), rng.randrange(0, 100), rng.choice([0, 1])
        tokens = [rng.randrange(50000) for _ in range(start + 1 - pending)]
        table = rng.sample(range(10000), (start + k) // 16 + 1)
        row = _row_of(real, tokens, 1 + k, start, pending, table, rng.randrange(64), k)
        t = rng.randrange(0, 32)
        want, got = ({name: np.full(t + k + 9, 7, dtype=np.int64) for name in FIELDS} for _ in range(2))
        fill_tokens(want, row, t, 16)
        rows_mod._rows.fill_tokens(row, got, t, 16)
        for name in FIELDS:
            assert np.array_equal(got[name], want[name]), name
    row.seq.block_table = table[:-1] if len(table) > 1 else []
    with pytest.raises(IndexError, match="missing from its block table"):
        rows_mod._rows.fill_tokens(row, got, 0, 16)


def _decode_rows(rng, n: int, block_size: int) -> list:
    rows = []
    for i in range(n):
        start, pending = rng.randrange(0, 300), rng.choice([0, 0, 1])
        tokens = [rng.randrange(50000) for _ in range(start + 1 - pending)]
        params = NS(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.9]))
        seq = NS(closer=None, block_table=rng.sample(range(10000), start // block_size + 1), num_tokens=len(tokens),
                 pool_row=i, num_pending=pending, token_at=tokens.__getitem__, params=params, seed=rng.randrange(2**40),
                 output_token_ids=tokens[:rng.randrange(len(tokens) + 1)])
        rows.append(NS(seq=seq, start=start, num_tokens=1, sample=rng.random() < 0.9, spec_k=0, sample_idx=-1))
    return rows


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_steps_fill_the_same_fields_as_the_row_by_row_writer(block_size):
    """_fill_decode (a plain step of one-token rows, in one native call) against _fill_rows: every field of
    the slot, the counts it returns and each row's sampling index are the same."""
    rng = random.Random(block_size)
    for n in (0, 1, 7, 32):
        rows = _decode_rows(rng, n, block_size)
        slots = [DecodeSlot(0, 64, 32, 400, torch.device("cpu")) for _ in range(2)]
        got = rows_mod._fill_decode(slots[0], rows, block_size)
        idx = [r.sample_idx for r in rows]
        want = rows_mod._fill_rows(slots[1], rows, block_size, 0)
        assert got == want and idx == [r.sample_idx for r in rows]
        for name, values in slots[1].np.items():
            assert np.array_equal(slots[0].np[name], values), (name, n)


class _Closer:
    """A closing row's forced tokens: output index i must be token 1000 + i from index `start`."""

    def __init__(self, start: int):
        self.start = start

    def forced_at(self, index: int) -> int:
        return 1000 + index if index >= self.start else -1


@pytest.mark.parametrize("block_size", [1, 16])
def test_the_native_decode_writer_writes_what_the_python_one_does(block_size):
    """engine/runner/csrc/rows.cpp against _fill_decode_py, its definition: every field, the counts, each row's
    sampling index and the slot's record of the tables it holds, over repeated fills of one slot pair (tables
    that grow, rows that swap places), with closing rows among them."""
    rng = random.Random(block_size + 5)
    native, python = (DecodeSlot(0, 512, 300, 400, torch.device("cpu")) for _ in range(2))
    rows = _decode_rows(rng, 40, block_size)
    for step in range(6):
        rows = [_advance(rng, r, block_size) for r in rows] + _decode_rows(rng, 2, block_size)
        for r in rng.sample(rows, 5):
            r.seq.closer = _Closer(rng.randrange(40))
        rows[rng.randrange(len(rows))].sample = False
        rng.shuffle(rows)
        got = rows_mod._rows.fill_decode(rows, native.np, native.bt_rows, block_size)
        idx = [r.sample_idx for r in rows]
        assert got == rows_mod._fill_decode_py(python, rows, block_size), step
        assert idx == [r.sample_idx for r in rows]
        for name, values in python.np.items():
            assert np.array_equal(native.np[name], values), (name, step)
        assert [(id(t), n) for t, n in native.bt_rows] == [(id(t), n) for t, n in python.bt_rows]


def test_a_row_the_native_writer_refuses_fails_by_its_index():
    """A pending row with no token-pool row: native code raises and the Python walk names the row."""
    rows = _decode_rows(random.Random(4), 5, 16)
    rows[3].seq.num_pending, rows[3].seq.pool_row = 1, -1
    slot = DecodeSlot(0, 64, 32, 400, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="token-pool row"):
        rows_mod._rows.fill_decode(rows, slot.np, slot.bt_rows, 16)
    with pytest.raises(rows_mod.RowError) as err:
        rows_mod._fill_decode(slot, rows, 16)
    assert err.value.index == 3 and "token-pool row" in str(err.value)


def test_a_decode_row_that_cannot_be_written_names_its_index():
    rows = _decode_rows(random.Random(3), 4, 16)
    rows[2].seq.block_table = []                  # its page is missing
    with pytest.raises(rows_mod.RowError) as err:
        rows_mod._fill_decode(DecodeSlot(0, 64, 32, 400, torch.device("cpu")), rows, 16)
    assert err.value.index == 2 and "IndexError" in str(err.value)


def _chunk_row(rng, block_size: int):
    """An admission's prompt chunk: n tokens from start, sampling when it ends the prompt."""
    start, n = rng.randrange(0, 100), rng.choice([2, 17, 64])
    total = start + n + rng.choice([0, 0, 5])
    tokens = [rng.randrange(50000) for _ in range(total)]
    params = NS(temperature=0.0, top_k=-1, top_p=1.0)
    seq = NS(closer=None, block_table=rng.sample(range(10000), (start + n) // block_size + 1), num_tokens=total,
             pool_row=40, num_pending=0, token_at=tokens.__getitem__, tokens=lambda a, b, tokens=tokens: tokens[a:b],
             params=params, seed=7, output_token_ids=[])
    return NS(seq=seq, start=start, num_tokens=n, sample=start + n == total, spec_k=0, sample_idx=-1, cached=0)


@pytest.mark.parametrize("block_size", [1, 16])
def test_a_speculating_engines_plain_decode_step_fills_as_row_by_row(block_size):
    """A speculating engine's plain step of one-token rows (native writer, then its spec fields a column at a time),
    some of them prompt tokens whose next token the host knows, then a prompt chunk: the fields of the row-by-row
    writer, speculation's included."""
    rng = random.Random(5 + block_size)
    for n in (1, 9, 30):
        rows = _decode_rows(rng, n, block_size)
        for row in rows:
            row.num_drafts, seq = 0, row.seq
            if not row.sample and not seq.num_pending:     # a prompt's token: the host knows the ones after it
                tokens = [seq.token_at(p) for p in range(seq.num_tokens)] + [rng.randrange(50000) for _ in range(3)]
                seq.num_tokens, seq.token_at = len(tokens), tokens.__getitem__
            seq.tokens = lambda a, b, seq=seq: [seq.token_at(p) for p in range(a, b)]
        chunk = _chunk_row(rng, block_size)
        chunk.num_drafts = 0
        rows.append(chunk)
        slots = [DecodeSlot(0, 512, 32, 400, torch.device("cpu"), spec_k=3) for _ in range(2)]
        got = rows_mod._fill(slots[0], rows, block_size, 3)
        idx = [r.sample_idx for r in rows]
        assert got == rows_mod._fill_rows(slots[1], rows, block_size, 3) and idx == [r.sample_idx for r in rows]
        for name, values in slots[1].np.items():
            assert np.array_equal(slots[0].np[name], values), (name, n)
    assert any(not r.sample for r in rows) and any(r.seq.num_pending for r in rows)


@pytest.mark.parametrize("block_size", [1, 16])
def test_the_native_writer_writes_a_speculating_engines_fields_as_python_does(block_size):
    """rows.cpp's fill_decode with spec=True against _fill_decode_py then spec_rows.fill_spec_decode, their
    definition: every field, prompt tokens whose next token the host knows and pending rows among them."""
    rng = random.Random(11 + block_size)
    for n in (1, 9, 30):
        rows = _decode_rows(rng, n, block_size)
        for row in rows:
            seq = row.seq
            if not row.sample and not seq.num_pending:
                tokens = [seq.token_at(p) for p in range(seq.num_tokens)] + [rng.randrange(50000) for _ in range(3)]
                seq.num_tokens, seq.token_at = len(tokens), tokens.__getitem__
        native, python = (DecodeSlot(0, 512, 32, 400, torch.device("cpu"), spec_k=3) for _ in range(2))
        got = rows_mod._rows.fill_decode(rows, native.np, native.bt_rows, block_size, True)
        want = rows_mod._fill_decode_py(python, rows, block_size)
        rows_mod.spec_rows.fill_spec_decode(python, rows, block_size)
        assert got == want
        for name, values in python.np.items():
            assert np.array_equal(native.np[name], values), (name, n)
    assert any(not r.sample for r in rows) and any(r.seq.num_pending for r in rows)


def _spec_rows(rng, n: int, k: int, block_size: int) -> list:
    """A spec step's rows: each its sequence's last token (known, or in flight after a spec step whose drafts the
    host counts as accepted) then k drafts, with pages for all of them."""
    rows = []
    for i in range(n):
        start, pending = rng.randrange(0, 300), rng.choice([0, 1 + k, 1])
        tokens = [rng.randrange(50000) for _ in range(start + 1 - min(pending, 1))]
        params = NS(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.9]))
        seq = NS(closer=None, block_table=rng.sample(range(10000), (start + k) // block_size + 1 + rng.randrange(2)),
                 num_tokens=len(tokens), pool_row=i, num_pending=pending, token_at=tokens.__getitem__,
                 tokens=lambda a, b, tokens=tokens: tokens[a:b], params=params, seed=rng.randrange(2**40),
                 output_token_ids=tokens[:rng.randrange(len(tokens) + 1)])
        rows.append(NS(seq=seq, start=start, num_tokens=1 + k, sample=True, spec_k=k, sample_idx=-1,
                       num_drafts=rng.randrange(k + 1)))
    return rows


@pytest.mark.parametrize("block_size,k", [(16, 3), (16, 6), (4, 3), (1, 2), (16, 16), (4, 12)])
def test_a_spec_step_fills_as_row_by_row(block_size, k):
    """A spec step's rows written a field at a time (engine/runner/spec_rows.py) hold what the row-by-row writer
    writes, speculation's fields included, whatever number of pages a row's drafts span (a draft tree's 1 + 16)."""
    rng = random.Random(block_size * 10 + k)
    for n in (1, 5, min(32, 512 // (k + 1))):          # (a slot of 512 tokens)
        rows = _spec_rows(rng, n, k, block_size)
        slots = [DecodeSlot(0, 512, 32, 400, torch.device("cpu"), spec_k=k) for _ in range(2)]
        got = rows_mod._fill(slots[0], rows, block_size, k)
        idx = [r.sample_idx for r in rows]
        assert got == rows_mod._fill_rows(slots[1], rows, block_size, k) and idx == [r.sample_idx for r in rows]
        for name, values in slots[1].np.items():
            assert np.array_equal(slots[0].np[name], values), (name, n)
        assert rows_mod.spec_rows.fill_spec_step(slots[0], rows, block_size) == got     # it refuses none here


def test_a_spec_row_that_cannot_be_written_names_its_index():
    rows = _spec_rows(random.Random(3), 6, 3, 16)
    rows[4].seq.block_table = rows[4].seq.block_table[:rows[4].start // 16]     # its pages are gone
    slot = DecodeSlot(0, 512, 32, 400, torch.device("cpu"), spec_k=3)
    with pytest.raises(rows_mod.RowError) as err:
        rows_mod._fill(slot, rows, 16, 3)
    assert err.value.index == 4


@pytest.mark.parametrize("lead", [3, 8, 28])
def test_a_step_of_decode_rows_then_prompt_chunks_fills_as_row_by_row(lead):
    """The agent's mixed step: leading decode rows (written in one native call)
    then prompt chunks (row by row, from where the decode rows ended) fill the slot as the row-by-row writer does."""
    rng = random.Random(lead)
    rows = _decode_rows(rng, lead, 16) + [_chunk_row(rng, 16) for _ in range(2)]
    slots = [DecodeSlot(0, 512, 32, 400, torch.device("cpu")) for _ in range(2)]
    got = rows_mod._fill(slots[0], rows, 16, 0)
    idx = [r.sample_idx for r in rows]
    assert got == rows_mod._fill_rows(slots[1], rows, 16, 0) and idx == [r.sample_idx for r in rows]
    for name, values in slots[1].np.items():
        assert np.array_equal(slots[0].np[name], values), name


def _advance(rng, row, block_size: int):
    """The same sequence one decode step on: its next position, its token known (or in flight), pages as needed."""
    seq, start = row.seq, row.start + 1
    tokens = [rng.randrange(50000) for _ in range(start + 1)]
    seq.block_table += [rng.randrange(10000) for _ in range(start // block_size + 1 - len(seq.block_table))]
    seq.num_pending = rng.choice([0, 1, 1])
    seq.num_tokens, seq.token_at = start + 1 - seq.num_pending, tokens.__getitem__
    seq.output_token_ids = tokens[:rng.randrange(start + 1)]
    return NS(seq=seq, start=start, num_tokens=1, sample=True, spec_k=0, sample_idx=-1)


def test_a_slot_filled_again_holds_what_a_fresh_fill_writes():
    """One slot filled step after step (rows keep their sequences, gain new ones, swap places, move up as rows
    before them finish; a sequence comes back with a new pool row; a row that does not sample; a mixed step;
    padding past the rows) holds, in every row it fills, what a fresh slot filled row by row holds."""
    rng, bs = random.Random(11), 16
    slot = DecodeSlot(0, 512, 40, 400, torch.device("cpu"))
    rows = _decode_rows(rng, 24, bs)
    for r in rows:
        r.sample = True
    for step in range(16):
        rows = [_advance(rng, r, bs) for r in rows]
        if step % 3 == 1:
            rows[rng.randrange(len(rows))] = _decode_rows(rng, 1, bs)[0]            # a new request in a row
        if step % 4 == 2:
            i, j = rng.sample(range(len(rows)), 2)
            rows[i], rows[j] = rows[j], rows[i]
        if step % 5 == 3:                       # requests finish: the rows after them move up, new ones join
            for _ in range(1 + step % 3):
                del rows[rng.randrange(len(rows) - 1)]
            rows += _decode_rows(rng, 1 + step % 3, bs)
            for r in rows[-1 - step % 3:]:
                r.sample = True
        if step == 5:
            rows[3].seq.pool_row = 39                                               # re-admitted elsewhere
        if step == 7:
            rows[1].sample = False
        chunks = [_chunk_row(rng, bs)] if step == 9 else []
        fresh = DecodeSlot(0, 512, 40, 400, torch.device("cpu"))
        got = rows_mod._fill(slot, rows + chunks, bs, 0)
        idx = [r.sample_idx for r in rows + chunks]
        assert got == rows_mod._fill_rows(fresh, rows + chunks, bs, 0)
        assert idx == [r.sample_idx for r in rows + chunks]
        t, s, n = got[0], got[1], len(rows + chunks)
        for i, r in enumerate(rows + chunks):        # a table's pages; past them a row may keep an older table's
            pages = len(r.seq.block_table)
            assert np.array_equal(slot.np["block_tables"][i, :pages], fresh.np["block_tables"][i, :pages])
        for name, values in fresh.np.items():
            if name == "block_tables":
                continue
            size = t if name in FIELDS else s if name in SAMPLING else n + (name == "cu_seqlens_q")
            assert np.array_equal(slot.np[name][:size], values[:size]), (name, step)
        pad_rows(slot, n, n + 4)                                                    # a graph's padding


def test_the_native_row_flags_are_the_python_ones():
    """rows.py's ROW_* bits of a step (native code against row_flags_py, their definition), each bit alone and
    mixed, a row that does not sample counting for penalties only."""
    rng = random.Random(9)
    seen = set()
    for _ in range(300):
        rows = []
        for _ in range(rng.randrange(0, 6)):
            params = NS(penalized=rng.random() < 0.1, logprobs=rng.choice([None] * 6 + [0, 3]),
                        temperature=rng.choice([0.0] * 5 + [0.7, 1]))
            seq = NS(params=params, guided=rng.choice([None] * 6 + [object()]))
            rows.append(NS(seq=seq, sample=rng.random() < 0.8))
        want = rows_mod.row_flags_py(rows)
        assert rows_mod._rows.row_flags(rows) == want
        seen.add(want)
    for bit in (1, 2, 4, 8):                # each bit came up set and unset
        assert {f & bit for f in seen} == {0, bit}
