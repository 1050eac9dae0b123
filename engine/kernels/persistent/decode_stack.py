"""A decode step's whole layer stack in one persistent launch, for steps of a few one-token rows.

    decode_stack_kernel[(programs,)](...)        (launched by engine/kernels/persistent/stack.py)

At one stream a layer is ~5 kernels whose weight reads take less time than their launches and tails. Here one
launch runs every layer: each program (one an SM) walks the step's tasks in order, task t of a layer's stages

    qkv (norm + QKV tiles) -> attention (row, kv head, KV split; RoPE, the new key's store, the splits' merge)
    -> o_proj (tiles, + residual) -> gate_up (norm + tiles, SiLU * up) -> down (tiles, + residual)

and after the last layer the final norm. Kernel boundaries become counters in global memory: a task of a stage
waits until every task of the stage before it has counted itself done. Before it waits, a task loads what does
not depend on that stage: its first weight chunk, the RoPE rows, the first tile of cached keys. So a layer's
weight reads start while the stage before still runs.

Invariants:
- No deadlock: every program takes its tasks in increasing order and every wait is on a stage of lower task
  numbers, so the lowest unfinished task can always run, as long as all programs are resident at once (one an
  SM, a grid of at most the SM count). The interpreter runs programs one after another: one program there.
- Ordering: a task's stores, a CTA barrier, then its count as a release atomic at GPU scope; a waiter's acquire
  atomic, then every read of another task's output past L1 (.cg).
- Buffers are reused by every layer: a stage's output is rewritten only by the same stage of the next layer,
  which waits (through the stages between) for every reader of the last one to finish.
- The counters are zero between launches: the last program to leave resets them (CUDA graph replays included).

The math and its rounding points are the reference path's (engine/models/llama.py): norms, projections, SiLU * up
and residual adds rounded to the model's dtype where it rounds, accumulation in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.attention.decode_attention import _cached_tile, _new_column
from engine.kernels.attention.paged_attention import _attn_tile
from engine.kernels.attention.split_merge import store_splits
from engine.kernels.common import is_interpreted, reduce_max, reduce_sum, round_to

STAGES = 5          # a layer's counters: qkv, attention, o_proj, gate_up, down (the kernel's `5`)


@triton.jit
def _wait(cnt_ptr, index, target):
    """Until counter `index` reaches `target`: polled with plain loads from L2, then one acquire atomic (it reads
    the last count, so it synchronizes with every release before it) and a CTA barrier, so that every thread's
    reads come after it."""
    while tl.load(cnt_ptr + index, volatile=True) < target:
        pass
    tl.atomic_add(cnt_ptr + index, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _signal(cnt_ptr, index):
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + index, 1, sem="release", scope="gpu")


@triton.jit
def _rows(ROWS: tl.constexpr, R_PAD: tl.constexpr):
    rows = tl.arange(0, R_PAD)
    return rows, rows < ROWS


@triton.jit
def _rstd(x_ptr, K, eps, ROWS: tl.constexpr, R_PAD: tl.constexpr, BK: tl.constexpr):
    """1 / rms of each row of x [ROWS, K] (contiguous), another task's output."""
    rows, r_ok = _rows(ROWS, R_PAD)
    ss = tl.zeros([R_PAD], tl.float32)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + offs[None, :], mask=r_ok[:, None] & (offs < K)[None, :], other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        ss += reduce_sum(x * x, 1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _weights(w_ptr, offs_n, n_ok, k0, K, BK: tl.constexpr):
    """Rows offs_n, columns k0 .. k0 + BK of a [N, K] weight (zeros past K or outside n_ok: no load)."""
    offs_k = k0 + tl.arange(0, BK)
    mask = n_ok[:, None] & (offs_k < K)[None, :]
    return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv(x_ptr, w_ptr, offs_n, n_ok, K, w, rstd, norm_ptr, NORM: tl.constexpr, ROWS: tl.constexpr,
          R_PAD: tl.constexpr, BK: tl.constexpr):
    """[R_PAD, BN] fp32: the rows of x [ROWS, K] (rms-normed by `norm_ptr`'s weight where NORM, rounded as the
    reference norm rounds) times weight rows offs_n. w: the weight's first chunk, loaded by the caller; each
    chunk's successor is loaded before the chunk's products."""
    rows, r_ok = _rows(ROWS, R_PAD)
    acc = tl.zeros([R_PAD, w.shape[0]], tl.float32)
    for k0 in range(0, K, BK):
        w_next = _weights(w_ptr, offs_n, n_ok, k0 + BK, K, BK)
        offs_k = k0 + tl.arange(0, BK)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * K + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        dtype = x.dtype
        x = x.to(tl.float32)
        if NORM:
            nw = tl.load(norm_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x = round_to(round_to(x * rstd[:, None], dtype).to(tl.float32) * nw[None, :], dtype).to(tl.float32)
        acc += reduce_sum(x[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        w = w_next
    return acc


@triton.jit
def _store_rows(ptr, offs_n, n_ok, N, y, ROWS: tl.constexpr, R_PAD: tl.constexpr):
    rows, r_ok = _rows(ROWS, R_PAD)
    tl.store(ptr + rows[:, None] * N + offs_n[None, :], round_to(y, ptr.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _residual(res_ptr, offs_n, n_ok, N, acc, ROWS: tl.constexpr, R_PAD: tl.constexpr):
    """res rows [ROWS, N] (columns offs_n) + acc rounded to the dtype, in fp32 (the reference's add)."""
    rows, r_ok = _rows(ROWS, R_PAD)
    res = tl.load(res_ptr + rows[:, None] * N + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0,
                  cache_modifier=".cg")
    return res.to(tl.float32) + round_to(acc, res.dtype).to(tl.float32)


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
def _attention(i, layer, cnt_ptr, qkv_ptr, attn_ptr, kc_ptr, vc_ptr, kv_layer_stride, part_acc, part_m, part_l,
               sem_ptr, seq_lens, bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qk_scale, stride_bt, stride_blk,
               stride_pos, stride_kvh, stride_cos, T_QKV: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    """Task i of a layer's attention: (row, kv head, split) as engine/kernels/attention/decode_attention.py runs it."""
    split = i % SPLITS
    kv_head = (i // SPLITS) % KVH
    row = i // (SPLITS * KVH)
    ctx = tl.load(seq_lens + row) - 1       # the new token's position; the cache holds keys [0, ctx)
    chunk = ((ctx + SPLITS) // SPLITS + TILE_N - 1) // TILE_N * TILE_N
    lo = split * chunk
    hi = tl.minimum(ctx + 1, lo + chunk)
    cached_hi = tl.minimum(hi, ctx)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    s = tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0)
    kc = kc_ptr + layer.to(tl.int64) * kv_layer_stride
    vc = vc_ptr + layer.to(tl.int64) * kv_layer_stride
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    kv_off_head = kv_head * stride_kvh
    k0, v0, n_ok = _cached_tile(kc, vc, bt_row, 1, lo, cached_hi, kv_off_head, stride_blk, stride_pos, offs_d, d_ok,
                                BLOCK_SIZE, TILE_N)
    _wait(cnt_ptr, layer * 5, T_QKV)
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
    if owns:
        acc, l_i, m_i = _new_column(acc, l_i, m_i, q, kn, vn, qk_scale)
    store_splits(acc, l_i, m_i, attn_ptr, part_acc, part_m, part_l, sem_ptr, row * KVH + kv_head, row + offs_m * 0,
                 head, row_ok, offs_d, d_ok, split, NH, NH * HEAD_DIM, HEAD_DIM, SPLITS, BLOCK_M, HEAD_PAD, True)


@triton.jit
def decode_stack_kernel(
        h_ptr, ha_ptr, qkv_ptr, attn_ptr, act_ptr, out_ptr, cnt_ptr, sem_ptr, part_acc, part_m, part_l,
        w_qkv, b_qkv, w_o, w_gu, w_d, n_in, n_post, n_final,
        kc_ptr, vc_ptr, kv_layer_stride, seq_lens, bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
        eps, qk_scale, stride_bt, stride_blk, stride_pos, stride_kvh, stride_cos,
        LAYERS: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
        ROWS: tl.constexpr, R_PAD: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
        BN_D: tl.constexpr, BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_D: tl.constexpr,
        PRECISION: tl.constexpr):
    """h [ROWS, H]: the embedded inputs, overwritten by each layer's output; out [ROWS, H]: the final norm's."""
    NQKV: tl.constexpr = (NH + 2 * KVH) * HEAD_DIM
    QS: tl.constexpr = NH * HEAD_DIM
    T_QKV: tl.constexpr = (NQKV + BN_QKV - 1) // BN_QKV
    T_ATT: tl.constexpr = ROWS * KVH * SPLITS
    T_O: tl.constexpr = (H + BN_O - 1) // BN_O
    T_GU: tl.constexpr = (INTER + BN_GU - 1) // BN_GU
    T_D: tl.constexpr = (H + BN_D - 1) // BN_D
    A1: tl.constexpr = T_QKV + T_ATT
    A2: tl.constexpr = A1 + T_O
    A3: tl.constexpr = A2 + T_GU
    T_LAYER: tl.constexpr = A3 + T_D
    for t in range(tl.program_id(0), LAYERS * T_LAYER + 1, tl.num_programs(0)):
        layer = t // T_LAYER
        i = t % T_LAYER
        base = layer * 5
        if layer == LAYERS:                 # the final norm, once every layer is done
            _wait(cnt_ptr, base - 1, T_D)
            rstd = _rstd(h_ptr, H, eps, ROWS, R_PAD, BK_QKV)
            for n0 in range(0, H, BN_O):
                offs_n = n0 + tl.arange(0, BN_O)
                n_ok = offs_n < H
                y = _gemv_free_norm(h_ptr, offs_n, n_ok, H, rstd, n_final, ROWS, R_PAD)
                _store_rows(out_ptr, offs_n, n_ok, H, y, ROWS, R_PAD)
        elif i < T_QKV:
            offs_n = i * BN_QKV + tl.arange(0, BN_QKV)
            n_ok = offs_n < NQKV
            w = w_qkv + layer.to(tl.int64) * (NQKV * H)
            w0 = _weights(w, offs_n, n_ok, 0, H, BK_QKV)
            if layer > 0:
                _wait(cnt_ptr, base - 1, T_D)
            rstd = _rstd(h_ptr, H, eps, ROWS, R_PAD, BK_QKV)
            acc = _gemv(h_ptr, w, offs_n, n_ok, H, w0, rstd, n_in + layer * H, True, ROWS, R_PAD, BK_QKV)
            if HAS_BIAS:
                acc += tl.load(b_qkv + layer * NQKV + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            _store_rows(qkv_ptr, offs_n, n_ok, NQKV, acc, ROWS, R_PAD)
            _signal(cnt_ptr, base)
        elif i < A1:
            _attention(i - T_QKV, layer, cnt_ptr, qkv_ptr, attn_ptr, kc_ptr, vc_ptr, kv_layer_stride, part_acc, part_m,
                       part_l, sem_ptr, seq_lens, bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qk_scale, stride_bt,
                       stride_blk, stride_pos, stride_kvh, stride_cos, T_QKV, NH, KVH, HEAD_DIM, HEAD_PAD, GROUP,
                       BLOCK_M, BLOCK_SIZE, TILE_N, SPLITS, PRECISION)
            _signal(cnt_ptr, base + 1)
        elif i < A2:
            offs_n = (i - A1) * BN_O + tl.arange(0, BN_O)
            n_ok = offs_n < H
            w = w_o + layer.to(tl.int64) * (H * QS)
            w0 = _weights(w, offs_n, n_ok, 0, QS, BK_O)
            _wait(cnt_ptr, base + 1, T_ATT)
            acc = _gemv(attn_ptr, w, offs_n, n_ok, QS, w0, w0, n_in, False, ROWS, R_PAD, BK_O)
            _store_rows(ha_ptr, offs_n, n_ok, H, _residual(h_ptr, offs_n, n_ok, H, acc, ROWS, R_PAD), ROWS, R_PAD)
            _signal(cnt_ptr, base + 2)
        elif i < A3:
            offs_n = (i - A2) * BN_GU + tl.arange(0, BN_GU)
            n_ok = offs_n < INTER
            w = w_gu + layer.to(tl.int64) * (2 * INTER * H)
            w0_gate = _weights(w, offs_n, n_ok, 0, H, BK_GU)
            w0_up = _weights(w, INTER + offs_n, n_ok, 0, H, BK_GU)
            _wait(cnt_ptr, base + 2, T_O)
            rstd = _rstd(ha_ptr, H, eps, ROWS, R_PAD, BK_GU)
            norm = n_post + layer * H
            gate = _gemv(ha_ptr, w, offs_n, n_ok, H, w0_gate, rstd, norm, True, ROWS, R_PAD, BK_GU)
            up = _gemv(ha_ptr, w, INTER + offs_n, n_ok, H, w0_up, rstd, norm, True, ROWS, R_PAD, BK_GU)
            gate = round_to(gate, act_ptr.dtype.element_ty).to(tl.float32)
            up = round_to(up, act_ptr.dtype.element_ty).to(tl.float32)
            _store_rows(act_ptr, offs_n, n_ok, INTER, gate / (1.0 + tl.exp(-gate)) * up, ROWS, R_PAD)
            _signal(cnt_ptr, base + 3)
        else:
            offs_n = (i - A3) * BN_D + tl.arange(0, BN_D)
            n_ok = offs_n < H
            w = w_d + layer.to(tl.int64) * (H * INTER)
            w0 = _weights(w, offs_n, n_ok, 0, INTER, BK_D)
            _wait(cnt_ptr, base + 3, T_GU)
            acc = _gemv(act_ptr, w, offs_n, n_ok, INTER, w0, w0, n_in, False, ROWS, R_PAD, BK_D)
            _store_rows(h_ptr, offs_n, n_ok, H, _residual(ha_ptr, offs_n, n_ok, H, acc, ROWS, R_PAD), ROWS, R_PAD)
            _signal(cnt_ptr, base + 4)
    # the last program out resets every counter for the next launch
    tl.debug_barrier()
    exit_index = LAYERS * 5
    if tl.atomic_add(cnt_ptr + exit_index, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        for c0 in range(0, exit_index + 1, 256):
            offs = c0 + tl.arange(0, 256)
            tl.store(cnt_ptr + offs, tl.zeros([256], tl.int32), mask=offs <= exit_index)


@triton.jit
def _gemv_free_norm(x_ptr, offs_n, n_ok, K, rstd, norm_ptr, ROWS: tl.constexpr, R_PAD: tl.constexpr):
    """The final norm of x's rows at columns offs_n, fp32 (rounded as the reference norm rounds)."""
    rows, r_ok = _rows(ROWS, R_PAD)
    x = tl.load(x_ptr + rows[:, None] * K + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0,
                cache_modifier=".cg")
    nw = tl.load(norm_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return round_to(x.to(tl.float32) * rstd[:, None], x.dtype).to(tl.float32) * nw[None, :]


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(decode_stack_kernel)
