"""engine.kernels.sampling.bitmask against engine.sampling.sampler.apply_bitmask (its torch twin). Without CUDA the
kernel runs in the Triton CPU interpreter (tests/conftest.py: triton_module)."""
import pytest
import torch

from conftest import triton_module
from engine.sampling.sampler import apply_bitmask as reference

kernel = triton_module("sampling.bitmask")
DEV = "cpu" if kernel.interpreted() else "cuda"


def _case(rows, vocab, words, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = 0                                        # allows nothing
    mask[1] = -1                                       # allows everything
    mask[2] = 0
    mask[2, (vocab - 1) // 32] = 1 << ((vocab - 1) % 32)   # only the last token
    if vocab % 32:
        mask[3] = 0
        mask[3, vocab // 32] = -1 << (vocab % 32)      # only bits past the vocabulary: allows nothing
    mask[4] = 0
    mask[4, 0] = -2**31                                # the sign bit alone: token 31
    return logits.to(DEV), mask.to(DEV)


@pytest.mark.parametrize("rows,vocab,words", [(6, 1000, 32), (7, 4100, 129), (5, 5000, 160)])
def test_kernel_matches_torch(rows, vocab, words):
    logits, mask = _case(rows, vocab, words, seed=vocab)
    want_logits = logits.clone()
    want = reference(want_logits, mask)
    got = kernel.apply_bitmask(logits, mask)
    assert got.tolist() == want.tolist()
    assert torch.equal(logits, want_logits)
    assert got[:5].tolist() == [False, True, True, vocab % 32 == 0, True]
    assert torch.isfinite(logits[2]).sum() == 1 and torch.isfinite(logits[4]).nonzero().flatten().tolist() == [31]


def test_kernel_on_a_row_slice_and_bad_arguments():
    logits, mask = _case(6, 1000, 40, seed=1)
    view = mask[:, :32]                                 # more words than needed, strided rows
    want_logits = logits.clone()
    assert kernel.apply_bitmask(logits, view).tolist() == reference(want_logits, view).tolist()
    assert torch.equal(logits, want_logits)
    with pytest.raises(ValueError, match="int32"):
        kernel.apply_bitmask(logits, mask.to(torch.int64))
    with pytest.raises(ValueError, match="words per row"):
        kernel.apply_bitmask(logits, mask[:, :8])
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        kernel.apply_bitmask(logits, mask[:3])
