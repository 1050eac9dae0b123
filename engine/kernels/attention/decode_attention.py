"""Decode attention with RoPE and the KV store of the new token, for steps of at most one new token a sequence:
engine/kernels/attention/paged_attention.py's `rope=` path, with as little as possible after the dependent-launch wait.

    decode_attention(q, k, v, positions, cos, sin, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                     slot_mapping, scale, ...) -> out         (= paged_attention(q, ..., rope=(k, v, positions, ...)))

At one stream attention is the longest kernel on a small model's critical path (docs/decode_step.md): in
each layer a chain of loads, each waiting on the one before (the query's offsets, its position, the RoPE rows, q,
the new key's store, a barrier, the page ids, the keys). Only q and the new key and value come from the kernel
before (the qkv matmul). So here, before the wait: the metadata (written by the step's upload), the RoPE rows of
the position, and the split's first tile of cached keys and values (earlier steps wrote them). After it: q and the
new key and value in one round of loads, their rotation in registers, the store of the new key and value for
later steps, and the products. The new key takes no part in the cache tiles (they stop below its position): the
split holding its position adds its term from registers, as one more column of the online softmax. No barrier.

Invariant for the reads before the wait: every input but q / k / v was written by the step's upload or by a kernel
at least two launches earlier (under dependent launch the kernel before this one has passed its own wait, so the
one before that has finished). The engine's decode steps and the EAGLE head's draft steps keep it; a caller
that computes metadata in the kernel right before this one must not use this kernel.

Math as paged_attention's: scores in the log2 domain, probabilities rounded to the cache dtype before the
product with V, fp32 accumulation; the new key and value are rounded to the cache dtype as the cache holds them.
The summation order differs (the new key's term comes last), so results agree to fp32 rounding.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from engine.kernels.attention.attention_checks import check_attention
from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_max, reduce_sum, sm_count
from engine.kernels.fused_ops import check_rope, rotate_rows
from engine.kernels.attention.paged_attention import _LOG2E, _attn_tile, _tile_config, online_update
from engine.kernels.attention.split_merge import combine_splits, merges, split_count, split_partials, store_splits

WIDE_HEAD = 128     # padded head sizes from which a program runs 8 warps (warps)
WIDE_TILE = 128     # keys a tile where an unsplit grid fills the SMs (tile_rule)
FULL_GRID = 1       # programs an SM from which a grid counts as full (tile_rule)


@triton.jit
def _decode_attn_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, out_ptr, part_acc, part_m, part_l, cu_q, seq_lens,
                        bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, sem_ptr, qk_scale, num_heads, stride_qt,
                        stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh, stride_bt_b,
                        stride_bt_n, stride_blk, stride_pos, stride_kvh, stride_cos,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        PREFETCH: tl.constexpr, PRECISION: tl.constexpr, MERGE: tl.constexpr, USE_PDL: tl.constexpr):
    split, seq, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # ---- before the wait: the step's inputs and the cache as earlier steps left it
    row = tl.load(cu_q + seq)
    if tl.load(cu_q + seq + 1) <= row:      # a padding sequence: no token
        return
    ctx = tl.load(seq_lens + seq) - 1       # the new token's position; the cache holds keys [0, ctx)
    active = active_splits(ctx, NUM_SPLITS, TILE_N)
    if MERGE and split >= active:           # no keys: the group's merge counts its active splits only
        return
    lo, hi, cached_hi = split_range(ctx, split, NUM_SPLITS, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    slot, c, s = row_rope(pos_ptr, slot_ptr, cos_ptr, sin_ptr, row, stride_cos, offs_d, d_ok)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt_b
    kv_off_head = kv_head * stride_kvh
    k0, v0, n_ok, k1, v1, n1_ok = prefetch_tiles_of(kc_ptr, vc_ptr, bt_row, stride_bt_n, lo, cached_hi, kv_off_head,
                                                    stride_blk, stride_pos, offs_d, d_ok, BLOCK_SIZE, TILE_N, PREFETCH)
    pdl_start(USE_PDL)
    # ---- after it: q and the new key and value, rotated in registers
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    qm = row_ok[:, None] & d_ok[None, :]
    q = rotate_rows(q_ptr + row.to(tl.int64) * stride_qt + head[:, None] * stride_qh, offs_d, qm, c[None, :],
                    s[None, :], HEAD_DIM).to(q_ptr.dtype.element_ty)
    new_m = (offs_m == 0)[:, None] & d_ok[None, :]      # the new key and value on row 0 of [BLOCK_M, HEAD_PAD]
    kn = rotate_rows(kn_ptr + row.to(tl.int64) * stride_knt + kv_head * stride_knh + offs_m[:, None] * 0, offs_d,
                     new_m, c[None, :], s[None, :], HEAD_DIM).to(kc_ptr.dtype.element_ty)
    vn = tl.load(vn_ptr + row.to(tl.int64) * stride_vnt + kv_head * stride_vnh + offs_m[:, None] * 0 + offs_d[None, :],
                 mask=new_m, other=0.0).to(vc_ptr.dtype.element_ty)
    owns = (ctx >= lo) & (ctx < hi)
    if owns & (slot >= 0):                  # later steps read them from the cache
        dst = slot * stride_pos + kv_off_head + offs_m[:, None] * 0 + offs_d[None, :]
        tl.store(kc_ptr + dst, kn, mask=new_m)
        tl.store(vc_ptr + dst, vn, mask=new_m)
    # ---- the products: the prefetched tile, the split's other cached tiles, the new key's column
    acc, l_i, m_i = cached_products(q, k0, v0, n_ok, k1, v1, n1_ok, qk_scale, kc_ptr, vc_ptr, bt_row, stride_bt_n,
                                    lo, cached_hi, ctx, kv_off_head, stride_blk, stride_pos, offs_d, d_ok, BLOCK_M,
                                    HEAD_PAD, BLOCK_SIZE, TILE_N, PREFETCH, PRECISION)
    if owns:
        acc, l_i, m_i = _new_column(acc, l_i, m_i, q, kn, vn, qk_scale)
    store_splits(acc, l_i, m_i, out_ptr, part_acc, part_m, part_l, sem_ptr, seq * tl.num_programs(2) + kv_head,
                 row + offs_m * 0, head, row_ok, offs_d, d_ok, split, num_heads, stride_ot, stride_oh, NUM_SPLITS,
                 BLOCK_M, HEAD_PAD, MERGE, active)


@triton.jit
def _chunk(ctx, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr):
    """Keys a split takes of a query at position ctx: an even share of ctx + 1, rounded up to whole tiles."""
    return ((ctx + NUM_SPLITS) // NUM_SPLITS + TILE_N - 1) // TILE_N * TILE_N


@triton.jit
def active_splits(ctx, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr):
    """The splits that hold keys of a query at position ctx: the first cdiv(ctx + 1, chunk). A launch sized for a
    context bound runs short contexts on fewer splits (a split takes whole tiles); the rest have nothing to add."""
    chunk = _chunk(ctx, NUM_SPLITS, TILE_N)
    return (ctx + chunk) // chunk


@triton.jit
def split_range(ctx, split, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr):
    """Split `split`'s keys [lo, hi) of a query at position ctx (keys [0, ctx] with its own), whole tiles a split,
    and the end of its cached ones, cached_hi = min(hi, ctx)."""
    chunk = _chunk(ctx, NUM_SPLITS, TILE_N)
    lo = split * chunk
    hi = tl.minimum(ctx + 1, lo + chunk)
    return lo, hi, tl.minimum(hi, ctx)


@triton.jit
def row_rope(pos_ptr, slot_ptr, cos_ptr, sin_ptr, row, stride_cos, offs_d, d_ok):
    """Token `row`'s cache slot and the cos / sin rows of its position."""
    pos = tl.load(pos_ptr + row).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    return tl.load(slot_ptr + row).to(tl.int64), c, s


@triton.jit
def _cached_tile(kc_ptr, vc_ptr, bt_row, stride_bt_n, start, cached_hi, kv_off_head, stride_blk, stride_pos, offs_d,
                 d_ok, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Keys start .. start + TILE_N below cached_hi of the sequence's cache: (k [HEAD_PAD, TILE_N], v [TILE_N,
    HEAD_PAD], their mask [TILE_N]); keys past cached_hi read as zeros (no load)."""
    offs_n = start + tl.arange(0, TILE_N)
    n_ok = offs_n < cached_hi
    page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_n, mask=n_ok, other=0).to(tl.int64)
    kv_off = page * stride_blk + (offs_n % BLOCK_SIZE) * stride_pos + kv_off_head
    k = tl.load(kc_ptr + kv_off[None, :] + offs_d[:, None], mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    v = tl.load(vc_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    return k, v, n_ok


@triton.jit
def prefetch_tiles_of(kc_ptr, vc_ptr, bt_row, stride_bt_n, lo, cached_hi, kv_off_head, stride_blk, stride_pos, offs_d,
                      d_ok, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PREFETCH: tl.constexpr):
    """A split's first PREFETCH (1 or 2) cached tiles, read before the wait: (k0, v0, n_ok, k1, v1, n1_ok); with one
    tile the second three repeat the first (unread)."""
    k0, v0, n_ok = _cached_tile(kc_ptr, vc_ptr, bt_row, stride_bt_n, lo, cached_hi, kv_off_head, stride_blk,
                                stride_pos, offs_d, d_ok, BLOCK_SIZE, TILE_N)
    if PREFETCH == 2:
        k1, v1, n1_ok = _cached_tile(kc_ptr, vc_ptr, bt_row, stride_bt_n, lo + TILE_N, cached_hi, kv_off_head,
                                     stride_blk, stride_pos, offs_d, d_ok, BLOCK_SIZE, TILE_N)
    else:
        k1, v1, n1_ok = k0, v0, n_ok
    return k0, v0, n_ok, k1, v1, n1_ok


@triton.jit
def cached_products(q, k0, v0, n_ok, k1, v1, n1_ok, qk_scale, kc_ptr, vc_ptr, bt_row, stride_bt_n, lo, cached_hi, ctx,
                    kv_off_head, stride_blk, stride_pos, offs_d, d_ok, BLOCK_M: tl.constexpr, HEAD_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PREFETCH: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax (acc, l_i, m_i) over a split's cached keys [lo, cached_hi): the prefetched tiles, as
    _attn_tile would take them (the same products, masks and order), then the rest."""
    scores = tl.where(n_ok[None, :], tl.dot(q, k0, input_precision=PRECISION) * qk_scale, float("-inf"))
    m_i = reduce_max(scores, 1)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = reduce_sum(p, 1)
    acc = tl.dot(p.to(v0.dtype), v0, tl.zeros((BLOCK_M, HEAD_PAD), tl.float32), input_precision=PRECISION)
    if PREFETCH == 2:
        s1 = tl.where(n1_ok[None, :], tl.dot(q, k1, input_precision=PRECISION) * qk_scale, float("-inf"))
        acc, l_i, m_i = online_update(acc, l_i, m_i, s1, v1, PRECISION)
    q_pos = tl.zeros((BLOCK_M,), tl.int32) + ctx
    for start in range(lo + PREFETCH * TILE_N, cached_hi, TILE_N):
        acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, q_pos, kc_ptr, vc_ptr, bt_row, stride_bt_n, start, cached_hi,
                                   kv_off_head, stride_blk, stride_pos, offs_d, d_ok, qk_scale, ctx, q_pos,
                                   BLOCK_SIZE, TILE_N, True, PRECISION, False)
    return acc, l_i, m_i


@triton.jit
def _new_column(acc, l_i, m_i, q, kn, vn, qk_scale):
    """The online softmax over one more key: kn / vn hold it on row 0 ([BLOCK_M, HEAD_PAD], zeros elsewhere)."""
    k_vec = reduce_sum(kn.to(tl.float32), 0)                    # row 0's values, as [HEAD_PAD]
    v_vec = reduce_sum(vn.to(tl.float32), 0)
    s_new = reduce_sum(q.to(tl.float32) * k_vec[None, :], 1) * qk_scale
    m_new = tl.maximum(m_i, s_new)
    alpha = tl.exp2(m_i - m_new)                                # m_new is finite: s_new is
    p_new = tl.exp2(s_new - m_new).to(vn.dtype).to(tl.float32)  # rounded as the tiles' probabilities are
    return acc * alpha[:, None] + p_new[:, None] * v_vec[None, :], l_i * alpha + tl.exp2(s_new - m_new), m_new


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_decode_attn_kernel)


def warps(head_pad: int, tile_warps: int) -> int:
    """8 warps for heads of 128 and wider, else the tile config's: at one stream a program's latency is the
    attention's, and at 4 warps Llama 8B's heads hold 255 registers a thread, 194 on 8 (sm_90): on 8 the
    attention's share of the step's critical path is shorter (docs/decode_step.md)."""
    return 8 if head_pad >= WIDE_HEAD else tile_warps


def prefetch_rule(num_splits: int, tile_n: int = 0) -> int:
    """Cached tiles a split reads before the wait: two where one split walks the whole context in tiles under
    WIDE_TILE (the second shortens attention's share of the step's critical path), one where the context is split
    (there a second lengthens it) or the tile is wide (the first already holds 128 keys; docs/decode_step.md)."""
    return 2 if num_splits == 1 and tile_n < WIDE_TILE else 1


def tile_rule(tile_n: int, num_splits: int, programs: int, device: torch.device) -> int:
    """Keys a tile: WIDE_TILE where the launch is unsplit and has FULL_GRID programs an SM or more, else tile_n.
    Such a grid runs in waves, and a wider tile puts more reads in flight a program; a smaller grid is split or
    short, and there the wider tile's registers cost the kernels around it more than it saves (docs/decode_step.md)."""
    if num_splits == 1 and device.type == "cuda" and programs >= FULL_GRID * sm_count(device):
        return max(tile_n, WIDE_TILE)
    return tile_n


def decode_attention(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, cu_seqlens_q, seq_lens,
                     block_tables, slot_mapping, scale, *, out=None, num_splits=None, max_seq_len=None,
                     semaphores=None, prefetch_tiles: int = 0):
    """paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, 1, rope=(k, v, positions,
    cos_cache, sin_cache, slot_mapping), ...) for steps of at most one new token a sequence: q [T, heads, D], k, v
    [T, kv_heads, D] not yet rotated or cached. num_splits, max_seq_len, semaphores, out: paged_attention's.
    prefetch_tiles (1 or 2; 0: by rule): the cached KV tiles of a split read before the dependent-launch wait."""
    check_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out)
    check_rope(q, k, v, positions, cos_cache, sin_cache, k_cache, v_cache, slot_mapping)
    if isinstance(scale, torch.Tensor):
        raise ValueError("scale must be a host number (a tensor would need a sync)")
    if prefetch_tiles not in (0, 1, 2):
        raise ValueError(f"prefetch_tiles must be 0 (by rule), 1 or 2, got {prefetch_tiles}")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_tokens > num_seqs:
        raise ValueError(f"decode_attention takes one token a sequence at most: {num_tokens} tokens, {num_seqs} "
                         "sequences")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, _, tile_n, tile_warps = _tile_config(group, 1, block_size)
    groups = num_seqs * num_kv_heads
    num_splits = split_count(num_splits, q.device, groups, block_tables, block_size, max_seq_len, tile_n)
    tile_n = tile_rule(tile_n, num_splits, groups, q.device)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    num_warps = warps(head_pad, tile_warps)
    part_acc, part_m, part_l = split_partials(out, num_splits, head_pad)
    prefetch_tiles = prefetch_tiles or prefetch_rule(num_splits, tile_n)
    merge = merges(num_splits, semaphores, groups, q.device)
    _decode_attn_kernel[(num_splits, num_seqs, num_kv_heads)](
        q, k, v, k_cache, v_cache, out, part_acc, part_m, part_l, cu_seqlens_q, seq_lens, block_tables, positions,
        slot_mapping, cos_cache, sin_cache, semaphores if merge else seq_lens, float(scale) * _LOG2E, num_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        cos_cache.stride(0), GROUP=group, BLOCK_M=block_m, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, TILE_N=tile_n, NUM_SPLITS=num_splits, PREFETCH=prefetch_tiles, num_warps=num_warps,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", MERGE=merge,
        **pdl(_decode_attn_kernel, q.device, num_tokens))
    if num_splits > 1 and not merge:
        combine_splits(part_acc, part_m, part_l, out, cu_seqlens_q, num_seqs, head_pad)
    return out
