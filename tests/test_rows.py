"""engine/runner/rows.py's token writer against the per-token definition of its fields."""
import random
from types import SimpleNamespace as NS

import numpy as np
import pytest

from engine.runner.rows import fill_tokens

FIELDS = ("positions", "slot_mapping", "tok_row", "carry_src", "input_ids")


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


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_rows_of_any_length_and_start_write_every_token_as_defined(block_size):
    rng = random.Random(block_size)
    for _ in range(200):
        n, start = rng.choice([1, 2, 5, 16, 17, 300]), rng.randrange(0, 400)
        pending = rng.choice([0, 0, 1])                    # the last token may still be in flight
        tokens = [rng.randrange(50000) for _ in range(start + n - pending)]
        table = rng.sample(range(10000), (start + n + block_size - 1) // block_size)
        seq = NS(block_table=table, num_tokens=len(tokens), pool_row=rng.randrange(64), num_pending=pending,
                 token_at=tokens.__getitem__, tokens=lambda a, b, tokens=tokens: tokens[a:b])
        row = NS(seq=seq, num_tokens=n, start=start, spec_k=0)
        t = rng.randrange(0, 64)
        h = {k: np.zeros(t + n + 8, dtype=np.int64) for k in FIELDS}
        fill_tokens(h, row, t, block_size)
        want = _reference(row, block_size)
        for k in FIELDS:
            assert h[k][t:t + n].tolist() == want[k], (k, n, start)
            assert not h[k][:t].any() and not h[k][t + n:].any(), k     # nothing outside the row's tokens
