"""The KV tiles of engine/kernels/paged_attention.py's kernel: a tile's keys and values loaded through the block
table, the online-softmax update over them, and the new tokens' keys put into a tile loaded before they existed.

A program loads its first tile before it waits for the kernel before it (dependent launch): only the keys below
the step's new ones, which earlier steps wrote. The new keys go in afterwards, from the cache (the kernel before
stored them) or from the program's own registers (rope=: it rotated and stored them itself), so the tile holds
the bits a load after the wait would have read.
"""
import triton
import triton.language as tl

from engine.kernels.common import reduce_max, reduce_sum


@triton.jit
def load_tile(kc_ptr, vc_ptr, bt_row, stride_bt_n, start, first, lim, kv_off_head, stride_blk, stride_pos, offs_d,
              d_ok, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr):
    """K [HEAD_PAD, TILE_N] and V [TILE_N, HEAD_PAD] of keys start .. start + TILE_N. MASKED: keys outside
    [first, lim) read as 0 (slots past a sequence's end may hold NaN); else every key is below lim."""
    offs_n = start + tl.arange(0, TILE_N)
    n_ok = (offs_n >= first) & (offs_n < lim)
    page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_n, mask=n_ok, other=0).to(tl.int64)
    kv_off = page * stride_blk + (offs_n % BLOCK_SIZE) * stride_pos + kv_off_head
    if MASKED:
        k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def put_new_keys(k, v, kn, vn, key_pos, start, TILE_N: tl.constexpr, PRECISION: tl.constexpr):
    """k [HEAD_PAD, TILE_N], v [TILE_N, HEAD_PAD] of keys start ..: with rows j of kn / vn [R, HEAD_PAD] at key
    positions key_pos [R] (-1: none) put in. A one-hot product moves them (each column sums one nonzero term: the
    value exactly)."""
    offs_n = start + tl.arange(0, TILE_N)
    hit = key_pos[:, None] == offs_n[None, :]
    onehot = hit.to(kn.dtype)
    new_k = tl.dot(tl.trans(kn), onehot, input_precision=PRECISION)
    new_v = tl.dot(tl.trans(onehot), vn, input_precision=PRECISION)
    is_new = reduce_max(hit.to(tl.int32), 0) > 0
    return tl.where(is_new[None, :], new_k.to(k.dtype), k), tl.where(is_new[:, None], new_v.to(v.dtype), v)


@triton.jit
def tile_update(acc, l_i, m_i, q, q_pos, k, v, start, hi, qk_scale, TILE_N: tl.constexpr, MASKED: tl.constexpr,
                PRECISION: tl.constexpr):
    """The online softmax (acc, l, m) of q's rows over one tile; MASKED: keys >= hi or past a row's position
    count for nothing."""
    offs_n = start + tl.arange(0, TILE_N)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # log2 domain
    if MASKED:
        s = tl.where((offs_n < hi)[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, reduce_max(s, 1))
    # A row may have seen no key yet (split ranges): keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + reduce_sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def attend_tile(acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, stride_bt_n, start, hi, kv_off_head, stride_blk,
                stride_pos, offs_d, d_ok, qk_scale, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """load_tile, then tile_update."""
    k, v = load_tile(kc_ptr, vc_ptr, bt_row, stride_bt_n, start, start, hi, kv_off_head, stride_blk, stride_pos,
                     offs_d, d_ok, BLOCK_SIZE, TILE_N, MASKED)
    return tile_update(acc, l_i, m_i, q, q_pos, k, v, start, hi, qk_scale, TILE_N, MASKED, PRECISION)
