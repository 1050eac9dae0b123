"""N-gram drafter: matches a plain Python reference, hand-written edge cases, fixed shapes, no host sync."""
import random

import pytest
import torch

from engine.speculative.drafters import DraftContext, Drafter, NgramDrafter, Proposal, ngram_propose
from engine.speculative.drafters.ngram import PAD_TOKEN


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The spec, spelled out: longest n first, then the most recent occurrence ending before the last token."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def batch(rows: list[list[int]], width: int | None = None, pad: int = 0):
    width = max(map(len, rows), default=0) if width is None else width
    history = torch.full((len(rows), width), pad, dtype=torch.int64)
    for r, row in enumerate(rows):
        history[r, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return history, torch.tensor([len(row) for row in rows], dtype=torch.int64)


def propose_lists(rows, k, min_n=1, max_n=3, **kw):
    drafts, num = ngram_propose(*batch(rows, **kw), k, min_n, max_n)
    return [drafts[r, :num[r]].tolist() for r in range(len(rows))], drafts, num


def test_matches_reference_on_random_histories():
    rng = random.Random(0)
    checked = matched = 0
    for _ in range(150):
        k, max_n = rng.randint(1, 6), rng.randint(1, 5)
        min_n = rng.randint(1, max_n)
        vocab, width = rng.randint(2, 6), rng.randint(1, 40)
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(0, width))] for _ in range(rng.randint(1, 8))]
        # Padding drawn from the same vocab, so it would match if it were read.
        padded = [row + [rng.randrange(vocab) for _ in range(width - len(row))] for row in rows]
        history = batch(padded)[0]
        lengths = torch.tensor([len(row) for row in rows])
        drafts, num = ngram_propose(history, lengths, k, min_n, max_n)
        for r, row in enumerate(rows):
            want = reference(row, k, min_n, max_n)
            assert num[r].item() == len(want), (row, k, min_n, max_n)
            assert drafts[r, :len(want)].tolist() == want, (row, k, min_n, max_n)
            assert (drafts[r, len(want):] == PAD_TOKEN).all()
            checked += 1
            matched += bool(want)
    assert matched > checked // 3 and matched < checked, "random cases should exercise both match and no match"


def test_matches_reference_on_long_histories():
    rng = random.Random(1)
    rows = [[rng.randrange(vocab) for _ in range(rng.randint(250, 400))] for vocab in (3, 5, 50, 1000)]
    for k, min_n, max_n in ((5, 1, 3), (8, 2, 6), (3, 4, 4)):
        got, _, _ = propose_lists(rows, k, min_n, max_n)
        assert got == [reference(row, k, min_n, max_n) for row in rows]


def test_history_cut_past_every_length_changes_no_draft():
    """The step hands the drafter its rows' histories cut at the graph's context bound (every valid token before
    it): the drafts are those of the whole history."""
    gen = torch.Generator().manual_seed(5)
    history = torch.randint(0, 6, (16, 300), generator=gen)
    lengths = torch.randint(0, 120, (16,), generator=gen)
    for bound in (lengths.max().item(), 121, 200):
        for k in (1, 3, 5):
            whole, cut = ngram_propose(history, lengths, k), ngram_propose(history[:, :bound], lengths, k)
            assert torch.equal(whole[0], cut[0]) and torch.equal(whole[1], cut[1]), (bound, k)


def test_no_match_gives_zero_drafts():
    got, drafts, num = propose_lists([[1, 2, 3, 4], [5], []], k=3)
    assert got == [[], [], []]
    assert torch.equal(num, torch.zeros(3, dtype=torch.int64))
    assert torch.equal(drafts, torch.zeros(3, 3, dtype=torch.int64))


def test_continuation_truncated_by_length():
    got, drafts, num = propose_lists([[7, 8, 9, 7]], k=5)
    assert got == [[8, 9, 7]] and num.tolist() == [3]
    assert drafts[0].tolist() == [8, 9, 7, 0, 0]


def test_most_recent_occurrence_wins():
    got, _, _ = propose_lists([[1, 2, 5, 9, 1, 2, 6, 1, 2]], k=2, max_n=2)
    assert got == [[6, 1]]


def test_longest_n_beats_more_recent_shorter_n():
    # "2 3" recurs more recently (followed by 7), but "1 2 3" matches earlier (followed by 9).
    got, _, _ = propose_lists([[1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]], k=2, max_n=3)
    assert got == [[9, 8]]
    got, _, _ = propose_lists([[1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]], k=2, max_n=2)
    assert got == [[7, 1]]


def test_min_n_excludes_short_matches():
    assert propose_lists([[1, 2, 9, 2]], k=2, min_n=2, max_n=3)[0] == [[]]
    assert propose_lists([[1, 2, 9, 2]], k=2, min_n=1, max_n=3)[0] == [[9, 2]]


def test_padding_beyond_length_is_ignored():
    # Row 0's padding holds its last token followed by more: it must not match. Row 1's continuation must
    # stop at its length, not run on into padding.
    history = torch.tensor([[1, 2, 3, 4, 4, 5, 6], [3, 5, 3, 9, 9, 9, 9]])
    drafts, num = ngram_propose(history, torch.tensor([4, 3]), k=3)
    assert num.tolist() == [0, 2]
    assert drafts.tolist() == [[0, 0, 0], [5, 3, 0]]


def test_short_rows_and_mixed_lengths():
    # lengths below max_n, including 0 and 1, next to a long row: each row on its own terms.
    rows = [[], [4], [4, 4], [4, 5, 4], [1, 2, 3, 1, 2, 3, 1, 2]]
    got, _, num = propose_lists(rows, k=4, min_n=1, max_n=3)
    assert got == [[], [], [4], [5, 4], [3, 1, 2]]
    assert num.tolist() == [0, 0, 1, 2, 3]


def test_periodic_run_overlaps_suffix():
    # The most recent occurrence may overlap the suffix; its continuation then ends at the history's end.
    assert propose_lists([[6, 6, 6, 6, 6]], k=4, max_n=3)[0] == [[6]]
    assert propose_lists([[6, 6, 6, 6, 6]], k=4, min_n=4, max_n=4)[0] == [[6]]
    assert propose_lists([[6, 6, 6, 6, 6]], k=4, min_n=5, max_n=5)[0] == [[]]


def test_shapes_and_dtypes_fixed_by_batch_and_k():
    for width in (0, 1, 2, 9):
        for k in (1, 4):
            for dtype in (torch.int64, torch.int32):
                history = torch.randint(3, (5, width), dtype=dtype)
                lengths = torch.randint(width + 1, (5,), dtype=dtype)
                drafts, num = ngram_propose(history, lengths, k, 1, 3)
                assert drafts.shape == (5, k) and drafts.dtype == torch.int64
                assert num.shape == (5,) and num.dtype == torch.int64
                assert ((num >= 0) & (num <= k)).all()
    drafts, num = ngram_propose(torch.zeros(0, 6, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 3)
    assert drafts.shape == (0, 3) and num.shape == (0,)


def test_no_data_dependent_host_ops_on_meta_tensors():
    # Meta tensors carry shapes but no data: .item(), .tolist(), .nonzero(), boolean-mask indexing and
    # `if tensor:` all raise on them, so getting fixed-shape outputs shows the code never reads values.
    history = torch.empty(7, 50, dtype=torch.int64, device="meta")
    lengths = torch.empty(7, dtype=torch.int64, device="meta")
    drafts, num = ngram_propose(history, lengths, 4, 2, 5)
    assert drafts.shape == (7, 4) and num.shape == (7,) and drafts.device.type == "meta"
    for read in (lambda: num.sum().item(), lambda: drafts.tolist(), lambda: history.nonzero()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()              # the probe works: data-dependent ops do fail on meta


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_sync_and_graph_capture_on_cuda():
    rng = random.Random(1)
    rows = [[rng.randrange(4) for _ in range(rng.randint(0, 30))] for _ in range(6)]
    history, lengths = (t.cuda() for t in batch(rows, width=32))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ngram_propose(history, lengths, 4, 1, 3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            drafts, num = ngram_propose(history, lengths, 4, 1, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows = [[rng.randrange(4) for _ in range(rng.randint(0, 32))] for _ in range(6)]
    new_history, new_lengths = batch(rows, width=32)
    history.copy_(new_history)
    lengths.copy_(new_lengths)
    graph.replay()
    for r, row in enumerate(rows):
        want = reference(row, 4, 1, 3)
        assert drafts[r, :num[r]].tolist() == want


def test_drafter_interface():
    drafter = NgramDrafter(3, min_n=2, max_n=4)
    assert isinstance(drafter, Drafter) and drafter.name == "ngram" and drafter.num_speculative_tokens == 3
    history, lengths = batch([[1, 2, 3, 1, 2]])
    out = drafter.propose(DraftContext(history, lengths))
    assert isinstance(out, Proposal)
    drafts, num = out
    assert drafts.tolist() == [[3, 1, 2]] and num.tolist() == [3]
    with pytest.raises(TypeError):
        Drafter()


@pytest.mark.parametrize("args", [(0, 1, 3), (-1, 1, 3), (2, 0, 3), (2, 3, 2), (2, 1, 0), (2.0, 1, 3),
                                  (True, 1, 3), (2, 1, "3")])
def test_argument_validation(args):
    with pytest.raises(ValueError):
        NgramDrafter(*args)
    with pytest.raises(ValueError):
        ngram_propose(torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64), *args)


def test_tensor_validation():
    with pytest.raises(ValueError):
        ngram_propose(torch.zeros(4, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 2)
    with pytest.raises(ValueError):
        ngram_propose(torch.zeros(2, 4, dtype=torch.int64), torch.ones(3, dtype=torch.int64), 2)
    with pytest.raises(ValueError):
        ngram_propose(torch.zeros(2, 4), torch.ones(2, dtype=torch.int64), 2)
