"""engine.kernels.speculative.head_ops.embed_pair_norm: the EAGLE head's input (embedding, two RMS norms, side by
side) in one kernel, with the bits of the torch embedding, stack and fused_ops.rms_norm it replaces.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import triton_module

ho = triton_module("speculative.head_ops")
fo = triton_module("fused_ops")
DEV = "cpu" if ho.interpreted() else "cuda"


def randn(*shape, seed, dtype):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,h", [(1, 64), (5, 96), (3, 576)])
def test_the_bits_of_embedding_stack_and_norm(n, h, dtype):
    emb, weight = randn(50, h, seed=1, dtype=dtype), randn(h, seed=2, dtype=dtype)
    feature = randn(n, h + 7, seed=3, dtype=dtype)[:, 3:3 + h]            # strided rows
    ids = torch.randint(0, 50, (n,), generator=torch.Generator(device=DEV).manual_seed(4), device=DEV)
    want = fo.rms_norm(torch.stack([F.embedding(ids, emb), feature], 1).reshape(-1, h), weight, 1e-5).view(n, 2 * h)
    assert torch.equal(ho.embed_pair_norm(ids, emb, feature, weight, 1e-5), want)


@pytest.mark.parametrize("n", [1, 5])
def test_ids_read_at_their_stride(n):
    """A draft tree's next tokens are a column of its ranked candidates ([N, width][:, 0]): row r's id is at r *
    width, not at r."""
    h = 64
    emb, weight = randn(50, h, seed=1, dtype=torch.float32), randn(h, seed=2, dtype=torch.float32)
    feature = randn(n, h, seed=3, dtype=torch.float32)
    ranked = torch.randint(0, 50, (n, 4), generator=torch.Generator(device=DEV).manual_seed(4), device=DEV)
    ids = ranked[:, 0]
    assert ids.stride(0) == 4
    want = ho.embed_pair_norm(ids.contiguous(), emb, feature, weight, 1e-5)
    assert torch.equal(ho.embed_pair_norm(ids, emb, feature, weight, 1e-5), want)


def test_refusals():
    emb, feature, w = torch.ones(8, 16, device=DEV), torch.ones(2, 16, device=DEV), torch.ones(16, device=DEV)
    ids = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="ids"):
        ho.embed_pair_norm(ids.float(), emb, feature, w, 1e-5)
    with pytest.raises(ValueError, match="shapes disagree"):
        ho.embed_pair_norm(ids[:1], emb, feature, w, 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        ho.embed_pair_norm(ids, emb.half(), feature, w, 1e-5)
    with pytest.raises(TypeError, match="eps"):
        ho.embed_pair_norm(ids, emb, feature, w, torch.tensor(1e-5))
    assert ho.embed_pair_norm(ids[:0], emb, feature[:0], w, 1e-5).shape == (0, 32)
