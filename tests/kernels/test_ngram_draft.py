"""engine.kernels.speculative.ngram_draft (n-gram drafting in one kernel) against the torch code it replaces,
`ngram_propose` over the gathered rows, exactly. Without CUDA the kernel runs in the Triton CPU interpreter
(tests/conftest.py)."""
import pytest
import torch

from conftest import triton_module
from engine.speculative.drafters.ngram import NgramDrafter, ngram_propose
from engine.speculative.drafters.base import DraftContext

nd = triton_module("speculative.ngram_draft")
DEV = "cpu" if nd.interpreted() else "cuda"


def _table(seed, rows, width, vocab):
    """A history table of few distinct tokens (so suffixes recur), and per context row a table row (some -1, the
    dummy last row, as graph padding rows read it) and a length from 0 to past the width."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (rows + 1, width), generator=g, dtype=torch.int32)
    n = rows + 2
    picks = torch.randint(-1, rows, (n,), generator=g)
    lengths = torch.randint(0, width + 3, (n,), generator=g)
    lengths[:3] = torch.tensor([0, 1, 2])
    return table.to(DEV), picks.to(DEV), lengths.to(DEV)


@pytest.mark.parametrize("k,min_n,max_n", [(3, 1, 3), (1, 1, 1), (5, 2, 4), (4, 3, 3)])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_equals_torch(k, min_n, max_n, vocab):
    table, rows, lengths = _table(k * 100 + vocab, 6, 40, vocab)
    for bound in (40, 23, 2):
        view = table[:, :bound]                     # the first columns, read in place
        got = nd.ngram_draft(view, rows, lengths, k, min_n, max_n)
        want = ngram_propose(view[rows], lengths, k, min_n, max_n)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (bound, got, want)
    assert (want[1] > 0).any() or bound == 2


def test_long_rows_cross_blocks():
    """Histories longer than one block of the kernel's walk, the best match in an early block."""
    table, rows, lengths = _table(7, 3, 1300, 3)
    table[0, :1300] = 9
    table[0, 10:16] = torch.tensor([1, 2, 0, 7, 7, 7], dtype=torch.int32)
    table[0, 1197:1200] = torch.tensor([1, 2, 0], dtype=torch.int32)
    rows[0], lengths[0] = 0, 1200
    got = nd.ngram_draft(table, rows, lengths, 3, 1, 3)
    want = ngram_propose(table[rows], lengths, 3, 1, 3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0][0].tolist() == [7, 7, 7] and int(got[1][0]) == 3


def test_drafter_with_kernels_equals_torch():
    table, rows, lengths = _table(3, 5, 30, 4)
    ctx = DraftContext(table, lengths, rows)
    on, off = NgramDrafter(3, spec_kernels=True).propose(ctx), NgramDrafter(3).propose(ctx)
    assert torch.equal(on.draft_tokens, off.draft_tokens) and torch.equal(on.num_drafts, off.num_drafts)
    whole = DraftContext(table[rows], lengths)              # no rows: the table is the context
    on = NgramDrafter(3, spec_kernels=True).propose(whole)
    assert torch.equal(on.draft_tokens, off.draft_tokens) and torch.equal(on.num_drafts, off.num_drafts)


def test_no_rows_and_refusals():
    table, rows, lengths = _table(1, 2, 10, 3)
    drafts, count = nd.ngram_draft(table, rows[:0], lengths[:0], 3, 1, 3)
    assert drafts.shape == (0, 3) and count.shape == (0,)
    with pytest.raises(ValueError, match="must match"):
        nd.ngram_draft(table, rows, lengths[:2], 3, 1, 3)
    with pytest.raises(ValueError, match="unit stride"):
        nd.ngram_draft(table.t(), rows, lengths, 3, 1, 3)
    with pytest.raises(ValueError, match="min_n"):
        nd.ngram_draft(table, rows, lengths, 3, 2, 1)
    with pytest.raises(TypeError, match="history dtype"):
        nd.ngram_draft(table.float(), rows, lengths, 3, 1, 3)
