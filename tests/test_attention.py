"""The torch reference paged attention equals dense causal attention on random inputs."""
import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention_torch, store_kv_torch


def _scatter(lens, block_size, num_blocks, gen):
    """Random, non-contiguous block tables for sequences of the given lengths."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, width = [], max(-(-n // block_size) for n in lens)
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[:need] + [0] * (width - need))
        perm = perm[need:]
    return torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [1, 16, 37]), ([5, 16], [5, 16]), ([3, 1, 8], [20, 9, 8])])
def test_paged_equals_dense(heads, kv_heads, q_lens, kv_lens):
    gen = torch.Generator().manual_seed(hash((heads, tuple(q_lens))) % 2**31)
    D, bs, nb = 32, 8, 64
    k_cache = torch.randn(nb, bs, kv_heads, D, generator=gen)
    v_cache = torch.randn(nb, bs, kv_heads, D, generator=gen)
    tables = _scatter(kv_lens, bs, nb, gen)
    full_k = [torch.randn(n, kv_heads, D, generator=gen) for n in kv_lens]
    full_v = [torch.randn(n, kv_heads, D, generator=gen) for n in kv_lens]
    q = torch.randn(sum(q_lens), heads, D, generator=gen)
    # write every position (cached and new) through the store path, in a random order
    slots, ks, vs = [], [], []
    for i, n in enumerate(kv_lens):
        for p in range(n):
            slots.append(int(tables[i, p // bs]) * bs + p % bs)
            ks.append(full_k[i][p]); vs.append(full_v[i][p])
    order = list(range(len(slots))); random.Random(0).shuffle(order)
    store_kv_torch(torch.stack([ks[j] for j in order]), torch.stack([vs[j] for j in order]), k_cache, v_cache,
                   torch.tensor([slots[j] for j in order]))
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.int64), cu, torch.tensor(kv_lens, dtype=torch.int32),
                             tables, max(q_lens), max(kv_lens))
    out = paged_attention_torch(q, k_cache, v_cache, meta, scale=D ** -0.5)
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        qi = q[cu[i]:cu[i + 1]].transpose(0, 1)                           # [H, ql, D]
        k = full_k[i].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = full_v[i].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        mask = torch.arange(kl)[None, :] <= torch.arange(kl - ql, kl)[:, None]
        ref = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_store_skips_padding_rows():
    k_cache = torch.zeros(4, 4, 1, 2)
    v_cache = torch.zeros(4, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    store_kv_torch(k, k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 1, 2)[[0, 5]].eq(1).all()
    assert k_cache.sum() == 4 and v_cache.sum() == 4
