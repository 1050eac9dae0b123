"""Verification attention: decode_attention's plan for steps of a few new tokens a sequence (a speculative step's
1 + K, a draft tree, or a short prefill chunk): paged_attention(rope=...) with as little as possible after the
dependent-launch wait.

    verify_attention(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, cu_seqlens_q, seq_lens,
                     block_tables, slot_mapping, scale, max_query_len, ...) -> out
                     (= paged_attention(q, ..., max_query_len, rope=(k, v, positions, ...), tree_masks=...))

A program owns (KV split, sequence, kv head) and all of the sequence's queries, packed as paged_attention packs a
query block (row m = new token m // GROUP, head m % GROUP). Before the wait: the metadata (written by the step's
upload), the RoPE rows of every new token's position, their cache slots, and the split's first tile of cached keys
and values (earlier steps wrote them). After it: q and the new keys and values in one round of loads, their
rotation in registers, the store of the new keys and values for later steps, and the products. The cached tiles
stop below the first new position; the split holding it adds the new keys from registers as one more tile, under
the causal mask (new key j is seen by the queries of new tokens j and later) or a draft tree's (new key j is seen
by the new tokens whose mask has bit j). No barrier: no program reads a key another stores in this launch.

Invariant for the reads before the wait: as decode_attention's, every input but q / k / v was written by the
step's upload or at least two launches earlier (the kernel right before this one is the layer's QKV matmul; a
tree's masks are the tree's own constant buffer).

Math as paged_attention's: scores in the log2 domain, probabilities rounded to the cache dtype before the product
with V, fp32 accumulation, the new keys and values rounded to the cache dtype as the cache holds them. The
summation order differs (the new keys' tile comes last), so results agree to fp32 rounding.
"""
from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from engine.kernels.attention.attention_checks import check_attention, check_tree
from engine.kernels.attention.decode_attention import (active_splits, cached_products, prefetch_rule,
                                                       prefetch_tiles_of, split_range, warps)
from engine.kernels.attention.paged_attention import _LOG2E, _tile_config, online_update
from engine.kernels.attention.rope_kv import rope_tables
from engine.kernels.attention.split_merge import combine_splits, merges, split_count, split_partials, store_splits
from engine.kernels.common import is_interpreted, pdl, pdl_start
from engine.kernels.fused_ops import check_rope, rotate_rows

MAX_NEW = 32        # new tokens a sequence this kernel takes (the new keys' tile): a chain's 1 + K, a tree of 31
# sequences of a step the engine routes here (preferred()): with more, paged_attention's launch is as fast or
# faster (docs/decode_step.md)
MAX_SEQS = 4


@triton.jit
def _verify_attn_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, out_ptr, part_acc, part_m, part_l, cu_q, seq_lens,
                        bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, sem_ptr, tree_ptr, qk_scale, num_heads, stride_qt,
                        stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh, stride_bt_b,
                        stride_bt_n, stride_blk, stride_pos, stride_kvh, stride_cos,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NEW: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, PREFETCH: tl.constexpr, PRECISION: tl.constexpr,
                        MERGE: tl.constexpr, TREE: tl.constexpr, USE_PDL: tl.constexpr):
    split, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # ---- before the wait: the step's inputs and the cache as earlier steps left it
    first = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - first
    if q_len <= 0:                          # a padding sequence: no token
        return
    ctx = tl.load(seq_lens + seq) - q_len   # the first new token's position; the cache holds keys [0, ctx)
    active = active_splits(ctx, NUM_SPLITS, TILE_N)
    if MERGE and split >= active:           # no keys: the group's merge counts its active splits only
        return
    lo, hi, cached_hi = split_range(ctx, split, NUM_SPLITS, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    head = kv_head * GROUP + offs_m % GROUP
    q_row = first + q_idx
    qm = row_ok[:, None] & d_ok[None, :]
    qc, qs = rope_tables(pos_ptr, cos_ptr, sin_ptr, q_row, row_ok, stride_cos, offs_d, qm)
    offs_j = tl.arange(0, NEW)
    new_ok = offs_j < q_len
    nm = new_ok[:, None] & d_ok[None, :]
    nc, ns = rope_tables(pos_ptr, cos_ptr, sin_ptr, first + offs_j, new_ok, stride_cos, offs_d, nm)
    slots = tl.load(slot_ptr + first + offs_j, mask=new_ok, other=-1).to(tl.int64)
    if TREE:                                # bit j of a new token's mask: it sees new token j
        bits = tl.load(tree_ptr + q_idx, mask=row_ok, other=0)
        seen = new_ok[None, :] & (((bits[:, None] >> offs_j[None, :].to(tl.int64)) & 1) != 0)
    else:
        seen = new_ok[None, :] & (offs_j[None, :] <= q_idx[:, None])
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt_b
    kv_off_head = kv_head * stride_kvh
    k0, v0, n_ok, k1, v1, n1_ok = prefetch_tiles_of(kc_ptr, vc_ptr, bt_row, stride_bt_n, lo, cached_hi, kv_off_head,
                                                    stride_blk, stride_pos, offs_d, d_ok, BLOCK_SIZE, TILE_N, PREFETCH)
    pdl_start(USE_PDL)
    # ---- after it: q and the new keys and values, rotated in registers
    q = rotate_rows(q_ptr + q_row.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh, offs_d, qm, qc, qs,
                    HEAD_DIM).to(q_ptr.dtype.element_ty)
    new_rows = (first + offs_j).to(tl.int64)
    kn = rotate_rows(kn_ptr + new_rows[:, None] * stride_knt + kv_head * stride_knh, offs_d, nm, nc, ns,
                     HEAD_DIM).to(kc_ptr.dtype.element_ty)
    vn = tl.load(vn_ptr + new_rows[:, None] * stride_vnt + kv_head * stride_vnh + offs_d[None, :], mask=nm,
                 other=0.0).to(vc_ptr.dtype.element_ty)
    owns = (ctx >= lo) & (ctx < hi)
    if owns:                                # later steps read them from the cache
        dst = slots[:, None] * stride_pos + kv_off_head + offs_d[None, :]
        stored = nm & (slots >= 0)[:, None]
        tl.store(kc_ptr + dst, kn, mask=stored)
        tl.store(vc_ptr + dst, vn, mask=stored)
    # ---- the products: the prefetched tile, the split's other cached tiles, the new keys' tile
    acc, l_i, m_i = cached_products(q, k0, v0, n_ok, k1, v1, n1_ok, qk_scale, kc_ptr, vc_ptr, bt_row, stride_bt_n,
                                    lo, cached_hi, ctx, kv_off_head, stride_blk, stride_pos, offs_d, d_ok, BLOCK_M,
                                    HEAD_PAD, BLOCK_SIZE, TILE_N, PREFETCH, PRECISION)
    if owns:
        s_new = tl.dot(q, tl.trans(kn), input_precision=PRECISION) * qk_scale
        acc, l_i, m_i = online_update(acc, l_i, m_i, tl.where(seen, s_new, float("-inf")), vn, PRECISION)
    store_splits(acc, l_i, m_i, out_ptr, part_acc, part_m, part_l, sem_ptr, seq * tl.num_programs(2) + kv_head,
                 q_row, head, row_ok, offs_d, d_ok, split, num_heads, stride_ot, stride_oh, NUM_SPLITS, BLOCK_M,
                 HEAD_PAD, MERGE, active)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_verify_attn_kernel)


def supports(num_heads: int, num_kv_heads: int, max_query_len: int, block_size: int) -> bool:
    """Whether steps of up to max_query_len new tokens a sequence fit one program's rows and new-key tile."""
    block_q = _tile_config(num_heads // num_kv_heads, max_query_len, block_size)[1]
    return 1 <= max_query_len <= min(MAX_NEW, block_q)


def preferred(num_seqs: int) -> bool:
    """Whether the engine routes a step of `num_seqs` sequences here rather than to paged_attention: a small grid,
    whose splits each wait on the QKV matmul, gains most from what this kernel reads before the wait."""
    return num_seqs <= MAX_SEQS


def verify_attention(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, cu_seqlens_q, seq_lens,
                     block_tables, slot_mapping, scale, max_query_len, *, out=None, num_splits=None, max_seq_len=None,
                     semaphores=None, prefetch_tiles: int = 0, tree_masks=None):
    """paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_query_len, rope=(k, v,
    positions, cos_cache, sin_cache, slot_mapping), ...) for steps of at most max_query_len (<= MAX_NEW) new tokens a
    sequence: q [T, heads, D], k, v [T, kv_heads, D] not yet rotated or cached. num_splits, max_seq_len, semaphores,
    out, prefetch_tiles: decode_attention's; tree_masks: paged_attention's (a draft tree; None: a causal chain)."""
    check_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    check_rope(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping)
    if isinstance(scale, torch.Tensor) or isinstance(max_query_len, torch.Tensor):
        raise ValueError("scale and max_query_len must be host numbers (a tensor would need a sync)")
    if prefetch_tiles not in (0, 1, 2):
        raise ValueError(f"prefetch_tiles must be 0 (by rule), 1 or 2, got {prefetch_tiles}")
    max_query_len = operator.index(max_query_len)
    if tree_masks is not None:
        check_tree(tree_masks, max_query_len, q.device)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not supports(num_heads, num_kv_heads, max_query_len, block_size):
        raise ValueError(f"verify_attention takes 1 to {MAX_NEW} new tokens a sequence that fit one query block; "
                         f"max_query_len {max_query_len} does not (run paged_attention)")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q, tile_n, tile_warps = _tile_config(group, max_query_len, block_size)
    groups = num_seqs * num_kv_heads
    num_splits = split_count(num_splits, q.device, groups, block_tables, block_size, max_seq_len, tile_n)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    part_acc, part_m, part_l = split_partials(out, num_splits, head_pad)
    merge = merges(num_splits, semaphores, groups, q.device)
    _verify_attn_kernel[(num_splits, num_seqs, num_kv_heads)](
        q, k, v, k_cache, v_cache, out, part_acc, part_m, part_l, cu_seqlens_q, seq_lens, block_tables, positions,
        slot_mapping, cos_cache, sin_cache, semaphores if merge else seq_lens,
        seq_lens if tree_masks is None else tree_masks, float(scale) * _LOG2E, num_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        cos_cache.stride(0), GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        NEW=max(16, triton.next_power_of_2(max_query_len)), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits,
        PREFETCH=prefetch_tiles or prefetch_rule(num_splits), num_warps=warps(head_pad, tile_warps),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", MERGE=merge, TREE=tree_masks is not None,
        **pdl(_verify_attn_kernel, q.device, num_tokens))
    if num_splits > 1 and not merge:
        combine_splits(part_acc, part_m, part_l, out, cu_seqlens_q, num_seqs, head_pad)
    return out
