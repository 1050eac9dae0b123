"""Triton kernels over the paged KV cache: store_kv, and one attention kernel for decode, prefill and
mixed steps (semantics: engine.attention.paged_attention_torch), optionally with RoPE and the KV store of the
step's new tokens folded in (`rope=`: engine.kernels.fused_ops.rope_store_kv, then this).

A program owns (query block, sequence, kv head[, KV split]). Its tile of BLOCK_M rows packs BLOCK_Q
query tokens x the GROUP q heads that share the kv head (row m = token m // GROUP, head m % GROUP), so
decode with a small GQA group still feeds tl.dot with M >= 16 and each K/V tile is loaded once per
group. KV is walked in TILE_N-key tiles (a multiple of the page size) through block_tables: first the
tiles every query row may see (no mask), then the causal tail. When the grid leaves the GPU mostly idle
(decode at low batch, or a fuller grid over a long context: split_merge's rule) the KV range is split over
NUM_SPLITS programs and a second kernel merges their partial (acc, max, sum), or with `semaphores=` the last
of them (both in engine/kernels/attention/split_merge.py). Grid
and constexprs depend only on shapes and host ints: no device->host sync, so both entry points can be captured
in CUDA graphs.

With `rope=` (steps whose every sequence's new tokens fit one query block: decode, verification, small trees),
the program rotates its q rows itself and, before walking KV, rotates and stores the new keys (and values) of its
kv head that fall in its split's range, then a CTA barrier makes them visible to its own loads. Each new key
lies in exactly one split's range and is read by no other program, so no other program waits on it: one kernel a
layer fewer. Rotation and rounding are rope_store_kv's, so the two paths give the same bits.
"""
from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from engine.kernels import fused_ops
from engine.kernels.attention.attention_checks import check_attention, check_cache, check_index, check_rows, check_tree
from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_max, reduce_sum
from engine.kernels.attention.rope_kv import rope_rows, store_new_kv
from engine.kernels.attention.split_merge import combine_splits, merges, split_count, split_partials, store_splits

_LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     num_kv_heads, stride_slot, stride_ch,
                     HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding row
        return
    offs_h = tl.arange(0, HEADS_PAD)[:, None]
    offs_d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (offs_h < num_kv_heads) & (offs_d < HEAD_DIM)
    dst = slot * stride_slot + offs_h * stride_ch + offs_d
    k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attn_tile(acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, stride_bt_n, start, hi, kv_off_head,
               stride_blk, stride_pos, offs_d, d_ok, qk_scale, ctx, tree_bits,
               BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
               TREE: tl.constexpr):
    offs_n = start + tl.arange(0, TILE_N)
    n_ok = offs_n < hi
    page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_n, mask=n_ok, other=0).to(tl.int64)
    kv_off = page * stride_blk + (offs_n % BLOCK_SIZE) * stride_pos + kv_off_head
    k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # log2 domain
    if MASKED:
        seen = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if TREE:    # a step's new keys: only the query's ancestors among them (bit j: new key j)
            j = tl.minimum(tl.maximum(offs_n - ctx, 0), 63).to(tl.int64)
            seen = seen & ((offs_n[None, :] < ctx) | (((tree_bits[:, None] >> j[None, :]) & 1) != 0))
        s = tl.where(seen, s, float("-inf"))
        # Slots past the sequence end may hold NaN garbage, and 0 * NaN = NaN: zero them.
        v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    return online_update(acc, l_i, m_i, s, v, PRECISION)


@triton.jit
def online_update(acc, l_i, m_i, s, v, PRECISION: tl.constexpr):
    """The running (acc, l_i, m_i) of the online softmax after one tile: scores s [BLOCK_M, TILE_N] in the log2
    domain, masked keys at -inf; values v [TILE_N, HEAD_PAD], masked keys' rows zero."""
    m_new = tl.maximum(m_i, reduce_max(s, 1))
    # A row may have seen no key yet (split ranges): keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + reduce_sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _paged_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_acc, part_m, part_l, cu_q, seq_lens, bt_ptr,
                       qk_scale, num_heads, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt_b, stride_bt_n,
                       stride_blk, stride_pos, stride_kvh, kn_ptr, vn_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
                       stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos, sem_ptr, tree_ptr,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                       ROPE: tl.constexpr, MERGE: tl.constexpr, TREE: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    q_block = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q + seq)
    q_len = tl.load(cu_q + seq + 1) - q_start
    q_lo = q_block * BLOCK_Q
    if q_lo >= q_len:
        return
    ctx = tl.load(seq_lens + seq) - q_len  # position of the sequence's first new token

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_lo + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    q_row = q_start + q_idx
    if ROPE:
        q = rope_rows(q_ptr, q_row, head, stride_qt, stride_qh, row_ok, pos_ptr, cos_ptr, sin_ptr, stride_cos, offs_d,
                       HEAD_DIM).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + q_idx
    if TREE:
        tree_bits = tl.load(tree_ptr + q_idx, mask=row_ok, other=0)
    else:
        tree_bits = q_idx

    # This block needs keys [0, kv_end); this split takes [lo, hi) of them, TILE_N-aligned.
    kv_end = tl.maximum(ctx + tl.minimum(q_lo + BLOCK_Q, q_len), 0)
    chunk = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + TILE_N - 1) // TILE_N * TILE_N
    lo = split * chunk
    hi = tl.minimum(kv_end, lo + chunk)
    # Keys below ctx + q_lo + 1 are visible to every row of the block (of a tree's, those below ctx + 1): those
    # tiles skip the mask.
    seen_by_all = ctx + 1 if TREE else ctx + q_lo + 1
    full_hi = lo + tl.maximum(tl.minimum(hi, seen_by_all) - lo, 0) // TILE_N * TILE_N

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, HEAD_PAD), 0.0, tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt_b
    kv_off_head = kv_head * stride_kvh
    if ROPE:  # one query block (the wrapper checks): this program's new keys are all this sequence's in [lo, hi)
        store_new_kv(kn_ptr, vn_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr, stride_knt, stride_knh,
                      stride_vnt, stride_vnh, stride_cos, stride_pos, kv_off_head, kv_head, q_start, q_len, ctx, lo,
                      hi, offs_d, BLOCK_M, HEAD_DIM)
        tl.debug_barrier()  # the CTA's stores above are visible to its loads below
    for start in range(lo, full_hi, TILE_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, stride_bt_n, start, hi,
                                   kv_off_head, stride_blk, stride_pos, offs_d, d_ok, qk_scale, ctx, tree_bits,
                                   BLOCK_SIZE, TILE_N, False, PRECISION, TREE)
    for start in range(full_hi, hi, TILE_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, stride_bt_n, start, hi,
                                   kv_off_head, stride_blk, stride_pos, offs_d, d_ok, qk_scale, ctx, tree_bits,
                                   BLOCK_SIZE, TILE_N, True, PRECISION, TREE)

    group_index = (q_block * tl.num_programs(1) + seq) * tl.num_programs(2) + kv_head
    store_splits(acc, l_i, m_i, out_ptr, part_acc, part_m, part_l, sem_ptr, group_index, q_row, head, row_ok, offs_d,
                 d_ok, split, num_heads, stride_ot, stride_oh, NUM_SPLITS, BLOCK_M, HEAD_PAD, MERGE, NUM_SPLITS)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_paged_attn_kernel)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """Write k/v [T, num_kv_heads, head_dim] into flat cache slots slot_mapping [T]; slot -1 writes nothing."""
    check_cache(k_cache, v_cache)
    for name, x in (("k", k), ("v", v)):
        check_rows(name, x, k_cache, k_cache.device)
        if x.shape[1] != k_cache.shape[2]:
            raise ValueError(f"{name} has {x.shape[1]} kv heads, the cache {k_cache.shape[2]}")
    check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    if not (k.shape[0] == v.shape[0] == slot_mapping.shape[0]):
        raise ValueError(f"k, v, slot_mapping disagree on T: {k.shape[0]}, {v.shape[0]}, {slot_mapping.shape[0]}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, k_cache.stride(1), k_cache.stride(2),
        HEADS_PAD=_pow2(num_kv_heads), HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim),
        **pdl(_store_kv_kernel, k.device, k.shape[0]))


def _tile_config(group: int, max_query_len: int, block_size: int):
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps) from host ints only."""
    block_m = min(128, _pow2(max(16, group * max_query_len)))
    block_m = max(block_m, _pow2(group))
    tile_n = max(block_size, 64)
    return block_m, block_m // group, tile_n, 8 if block_m >= 128 else 4


def fuses_rope(num_heads: int, num_kv_heads: int, max_query_len: int, block_size: int) -> bool:
    """Whether paged_attention takes `rope=` for steps of up to max_query_len new tokens a sequence: all of a
    sequence's queries in one block (no other program may need the keys one stores)."""
    return max_query_len <= _tile_config(num_heads // num_kv_heads, max_query_len, block_size)[1]


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_query_len,
                    *, out=None, num_splits=None, max_seq_len=None, rope=None, semaphores=None, tree_masks=None):
    """Causal attention of q [T, num_heads, head_dim] over the paged cache; returns out [T, num_heads, head_dim].

    max_query_len: host int >= every sequence's query length. out: optional buffer to write into (rows
    past cu_seqlens_q[-1] are left as they are). num_splits: KV splits (power of two), default by grid size
    and max_seq_len (a host bound on seq_lens; default: the block tables' capacity). Any split count is
    correct for any seq_lens: the bound only sizes the parallelism.
    rope: (k, v, positions, cos_cache, sin_cache, slot_mapping), rope_store_kv's arguments: q and k are not yet
    rotated, and the new keys and values are not yet cached; the kernel does both, as rope_store_kv would
    (q / k / v may be strided views). Needs fuses_rope(...) for max_query_len.
    semaphores: a zeroed int32 buffer (left zeroed) of at least one counter per (query block, sequence, kv head):
    with it a split launch merges its splits itself (engine/kernels/attention/split_merge.py), not in a second kernel.
    tree_masks: [n] int64 (engine/attention.py AttentionMetadata.tree_masks): every sequence's n new tokens are a
    draft tree, new token i attending to new token j where bit j of tree_masks[i] is set.
    """
    check_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    if isinstance(max_query_len, torch.Tensor) or isinstance(scale, torch.Tensor):
        raise ValueError("max_query_len and scale must be host numbers (a tensor would need a sync)")
    max_query_len = operator.index(max_query_len)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if rope is not None:
        _check_rope(q, rope, k_cache, v_cache, max_query_len)
    if tree_masks is not None:
        check_tree(tree_masks, max_query_len, q.device)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    block_m, block_q, tile_n, num_warps = _tile_config(group, max_query_len, block_size)
    q_blocks = triton.cdiv(max_query_len, block_q)
    groups = q_blocks * num_seqs * num_kv_heads
    num_splits = split_count(num_splits, q.device, groups, block_tables, block_size, max_seq_len, tile_n)
    head_pad = max(16, _pow2(head_dim))
    part_acc, part_m, part_l = split_partials(out, num_splits, head_pad)
    k, v, positions, cos, sin, slots = rope if rope is not None else (q, q, seq_lens, q, q, seq_lens)  # unread
    merge = merges(num_splits, semaphores, groups, q.device)
    _paged_attn_kernel[(q_blocks * num_splits, num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, cu_seqlens_q, seq_lens, block_tables,
        float(scale) * _LOG2E, num_heads, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k, v, positions, cos, sin, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        semaphores if merge else seq_lens, seq_lens if tree_masks is None else tree_masks,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits, num_warps=num_warps,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: exact products, for equality tests
        ROPE=rope is not None, MERGE=merge, TREE=tree_masks is not None,
        **pdl(_paged_attn_kernel, q.device, num_tokens))
    if num_splits > 1 and not merge:
        combine_splits(part_acc, part_m, part_l, out, cu_seqlens_q, num_seqs, head_pad)
    return out


def _check_rope(q, rope, k_cache, v_cache, max_query_len: int) -> None:
    if not isinstance(rope, (tuple, list)) or len(rope) != 6:
        raise ValueError("rope must be (k, v, positions, cos_cache, sin_cache, slot_mapping)")
    k, v, positions, cos, sin, slots = rope
    fused_ops.check_rope(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
    if not fuses_rope(q.shape[1], k_cache.shape[2], max_query_len, k_cache.shape[1]):
        raise ValueError(f"rope= needs every sequence's queries in one block; max_query_len {max_query_len} is "
                         "too many (fuses_rope): run fused_ops.rope_store_kv, then paged_attention")
