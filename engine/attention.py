"""Attention over a paged KV cache: the metadata every backend reads, and the torch reference that the torch backend
runs and the Triton kernels (engine/kernels/attention/) are checked against (engine/backend.py).

Layout (per layer): k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim]. A step holds B sequences
with a variable number of new (query) tokens each, flattened to T tokens. Sequence i's new tokens are
q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]; its KV length after this step is seq_lens[i], so its j-th new token sits at
position seq_lens[i] - q_len_i + j and attends to positions 0..that position (causal); in a draft-tree step
(`tree_masks`) it attends to the context before the step's new tokens and to those of them its mask names
(engine/speculative/tree.py). New K/V are written to the cache first (slot_mapping, -1 = no write, used by padding
rows), then attention reads everything from the pages.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] int64: block * block_size + offset, or -1
    cu_seqlens_q: torch.Tensor   # [B+1] int32
    seq_lens: torch.Tensor       # [B] int32, KV length after this step
    block_tables: torch.Tensor   # [B, max_blocks] int32
    max_query_len: int           # host-known upper bound of the per-sequence query length
    max_seq_len: int             # host-known upper bound of seq_lens
    tree_masks: torch.Tensor | None = None  # [n] int64: every sequence's n new tokens are a tree, bit j: sees token j


def store_kv_torch(k, v, k_cache, v_cache, slot_mapping):
    """Write new keys/values into their cache slots; rows with slot -1 write nothing."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def paged_attention_torch(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    """Reference: gathers each sequence's pages and runs dense causal attention in float32, one sequence at a time
    (a row's result does not depend on the sequences beside it). The query heads sharing a KV head are one
    matmul against it (no copies of the keys per query head)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q.tolist()
    lens = meta.seq_lens.tolist()
    tables = meta.block_tables.long()
    for i, kv_len in enumerate(lens):
        q_start, q_end = cu[i], cu[i + 1]
        n = q_end - q_start
        if n == 0:
            continue
        blocks = tables[i, :(kv_len + block_size - 1) // block_size]
        k = k_cache[blocks].flatten(0, 1)[:kv_len].float().permute(1, 2, 0)       # [kv heads, head_dim, kv_len]
        v = v_cache[blocks].flatten(0, 1)[:kv_len].float().transpose(0, 1)        # [kv heads, kv_len, head_dim]
        # [kv heads, group * n, head_dim]: query row r of a KV head is its head r // n, token r % n
        qi = q[q_start:q_end].float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(qi.reshape(num_kv_heads, group * n, head_dim), k) * scale
        if n > 1:                   # token t sees keys up to its position kv_len - n + t: among the last n keys
            scores.view(num_kv_heads, group, n, kv_len)[..., kv_len - n:].masked_fill_(_hidden(n, meta, q.device),
                                                                                       float("-inf"))
        o = torch.bmm(scores.softmax(-1), v).view(num_kv_heads, group, n, head_dim)
        out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim).to(q.dtype)
    return out


def _hidden(n: int, meta: AttentionMetadata, device) -> torch.Tensor:
    """[n, n] bool: new token i does not see new token j (causal, or outside its tree mask)."""
    if meta.tree_masks is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)
    if meta.tree_masks.shape[0] != n:
        raise ValueError(f"a tree step's sequences have {meta.tree_masks.shape[0]} new tokens each, one has {n}")
    bits = torch.arange(n, device=device)
    return (meta.tree_masks.to(device)[:, None] >> bits[None, :]) & 1 == 0
