"""The persistent decode stack's attention task (engine/kernels/persistent/decode_stack.py): one (row, KV head, KV
split) of a layer, as engine/kernels/attention/decode_attention.py runs it, with q and the new key and value read
from the stack's QKV buffer past L1 once the QKV stage is done, and the splits merged by their last program."""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.attention.decode_attention import _cached_tile, _new_column, row_rope, split_range
from engine.kernels.attention.paged_attention import _attn_tile
from engine.kernels.attention.split_merge import store_splits
from engine.kernels.common import reduce_max, reduce_sum, round_to
from engine.kernels.persistent.sync import _wait


@triton.jit
def _rotate_cg(base, offs_d, mask, c, s, HEAD_DIM: tl.constexpr):
    """engine.kernels.fused_ops.rotate_rows reading past L1 (q and the new key are another task's output)."""
    half = HEAD_DIM // 2
    partner = tl.where(offs_d < HEAD_DIM, tl.where(offs_d < half, offs_d + half, offs_d - half), 0)
    sign = tl.where(offs_d < half, -1.0, 1.0)
    x = tl.load(base + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return x * c + sign[None, :] * xp * s


@triton.jit
def _new_key(acc, l_i, m_i, q, qkv_ptr, t, pos_ptr, cos_ptr, sin_ptr, stride_cos, kv_head, offs_m, offs_d, d_ok,
             qk_scale, DTYPE: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The online softmax over token t's new key and value, rotated at its position and rounded as the cache holds
    them."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    new_m = (offs_m == 0)[:, None] & d_ok[None, :]
    base = qkv_ptr + t * ((NH + 2 * KVH) * HEAD_DIM) + (NH + kv_head) * HEAD_DIM + offs_m[:, None] * 0
    kn = round_to(_rotate_cg(base, offs_d, new_m, c[None, :], s[None, :], HEAD_DIM), DTYPE)
    vn = tl.load(base + KVH * HEAD_DIM + offs_d[None, :], mask=new_m, other=0.0, cache_modifier=".cg").to(DTYPE)
    return _new_column(acc, l_i, m_i, q, kn, vn, qk_scale)


@triton.jit
def _attention(i, layer, qkv_index, cnt_ptr, qkv_ptr, attn_ptr, kc_ptr, vc_ptr, kv_layer_stride, part_acc, part_m,
               part_l, sem_ptr, cu_q, seq_lens, bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qk_scale, stride_bt,
               stride_blk, stride_pos, stride_kvh, stride_cos, T_QKV: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLITS: tl.constexpr, SEQS: tl.constexpr,
               PRECISION: tl.constexpr):
    """Task i of a layer's attention: (row, kv head, split) as engine/kernels/attention/decode_attention.py runs it,
    once counter qkv_index says the layer's QKV stage is done.
    A row is a token; its sequence's earlier new tokens (a verification step's) are not in the cache yet: the split
    holding the cache's end adds them and the row's own key from the QKV buffer, as columns of the online softmax."""
    split = i % SPLITS
    kv_head = (i // SPLITS) % KVH
    row = i // (SPLITS * KVH)
    seq = row * 0                           # the row's sequence: the sequence starts at or below it (cu_q[0] = 0)
    for j in tl.static_range(1, SEQS):
        seq += (tl.load(cu_q + j) <= row).to(tl.int32)
    q_start = tl.load(cu_q + seq)
    q_end = tl.load(cu_q + seq + 1)
    # keys the cache held before the step, [0, ctx); -1 for a row past the last sequence (graph padding)
    ctx = tl.where(row < q_end, tl.load(seq_lens + seq) - (q_end - q_start), -1)
    lo, hi, cached_hi = split_range(ctx, split, SPLITS, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    slot, c, s = row_rope(pos_ptr, slot_ptr, cos_ptr, sin_ptr, row, stride_cos, offs_d, d_ok)
    kc = kc_ptr + layer.to(tl.int64) * kv_layer_stride
    vc = vc_ptr + layer.to(tl.int64) * kv_layer_stride
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_off_head = kv_head * stride_kvh
    k0, v0, n_ok = _cached_tile(kc, vc, bt_row, 1, lo, cached_hi, kv_off_head, stride_blk, stride_pos, offs_d, d_ok,
                                BLOCK_SIZE, TILE_N)
    _wait(cnt_ptr, qkv_index, T_QKV)
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    qkv_row = qkv_ptr + row.to(tl.int64) * ((NH + 2 * KVH) * HEAD_DIM)
    q = round_to(_rotate_cg(qkv_row + head[:, None] * HEAD_DIM, offs_d, row_ok[:, None] & d_ok[None, :], c[None, :],
                            s[None, :], HEAD_DIM), kc.dtype.element_ty)
    new_m = (offs_m == 0)[:, None] & d_ok[None, :]
    kn_base = qkv_row + (NH + kv_head) * HEAD_DIM + offs_m[:, None] * 0
    kn = round_to(_rotate_cg(kn_base, offs_d, new_m, c[None, :], s[None, :], HEAD_DIM), kc.dtype.element_ty)
    vn = tl.load(kn_base + KVH * HEAD_DIM + offs_d[None, :], mask=new_m, other=0.0,
                 cache_modifier=".cg").to(vc.dtype.element_ty)
    owns = (ctx >= lo) & (ctx < hi)
    if owns & (slot >= 0):                  # later steps read them from the cache
        dst = slot * stride_pos + kv_off_head + offs_m[:, None] * 0 + offs_d[None, :]
        tl.store(kc + dst, kn, mask=new_m)
        tl.store(vc + dst, vn, mask=new_m)
    scores = tl.where(n_ok[None, :], tl.dot(q, k0, input_precision=PRECISION) * qk_scale, float("-inf"))
    m_i = reduce_max(scores, 1)
    p = tl.exp2(scores - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
    l_i = reduce_sum(p, 1)
    acc = tl.dot(p.to(v0.dtype), v0, tl.zeros((BLOCK_M, HEAD_PAD), tl.float32), input_precision=PRECISION)
    q_pos = tl.zeros((BLOCK_M,), tl.int32) + ctx
    for start in range(lo + TILE_N, cached_hi, TILE_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, q_pos, kc, vc, bt_row, 1, start, cached_hi, kv_off_head,
                                   stride_blk, stride_pos, offs_d, d_ok, qk_scale, ctx, q_pos, BLOCK_SIZE, TILE_N,
                                   True, PRECISION, False)
    if owns:        # the sequence's new keys up to the row's own, in order
        for t in range(q_start, row + 1):
            acc, l_i, m_i = _new_key(acc, l_i, m_i, q, qkv_ptr, t, pos_ptr, cos_ptr, sin_ptr, stride_cos, kv_head,
                                     offs_m, offs_d, d_ok, qk_scale, kc.dtype.element_ty, NH, KVH, HEAD_DIM)
    store_splits(acc, l_i, m_i, attn_ptr, part_acc, part_m, part_l, sem_ptr, row * KVH + kv_head, row + offs_m * 0,
                 head, row_ok, offs_d, d_ok, split, NH, NH * HEAD_DIM, HEAD_DIM, SPLITS, BLOCK_M, HEAD_PAD, True,
                 SPLITS)
