"""A step's whole layer stack in one persistent launch, for steps of up to 4 tokens (decode or verification).

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
- Ordering: a task's stores, a CTA barrier, then its count as a release atomic at GPU scope; a waiter polls the
  count, takes it with an acquire atomic and a CTA barrier, then reads another task's output past L1 (.cg).
- Buffers are reused by every layer: a stage's output is rewritten only by the same stage of the next layer,
  which waits (through the stages between) for every reader of the last one to finish.
- The counters are zero between launches: the last program to leave resets them (CUDA graph replays included).

The math and its rounding points are the reference path's (engine/models/llama.py): norms, projections, SiLU * up
and residual adds rounded to the model's dtype where it rounds, accumulation in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, reduce_sum, round_to
from engine.kernels.persistent.stack_attention import _attention
from engine.kernels.persistent.sync import _signal, _wait

STAGES = tl.constexpr(5)    # a layer's counters: qkv, attention, o_proj, gate_up, down


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
def _matmul_task(j, layer, cnt_ptr, wait_index, wait_target, done_index, x_ptr, w_layers, N: tl.constexpr,
                 K: tl.constexpr, norm_ptr, eps, bias_layers, res_ptr, out_ptr, aux_ptr, aux_map, NORM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, AUX: tl.constexpr, ROWS: tl.constexpr,
                 R_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Tile j of a matmul stage of `layer`: out[:, tile] = x (rms-normed where NORM) @ W[tile].T (+ bias) (+ res),
    W the layer's [N, K] slice of w_layers; first waits for counter wait_index (none where it is negative). AUX: the
    layer's output also goes to aux slot aux_map[layer] ([slots, ROWS, N]) where that is not negative."""
    offs_n = j * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    w = w_layers + layer.to(tl.int64) * (N * K)
    w0 = _weights(w, offs_n, n_ok, 0, K, BK)
    if wait_index >= 0:
        _wait(cnt_ptr, wait_index, wait_target)
    if NORM:
        rstd = _rstd(x_ptr, K, eps, ROWS, R_PAD, BK)
    else:
        rstd = tl.zeros([R_PAD], tl.float32)
    acc = _gemv(x_ptr, w, offs_n, n_ok, K, w0, rstd, norm_ptr, NORM, ROWS, R_PAD, BK)
    if HAS_BIAS:
        acc += tl.load(bias_layers + layer * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if RESIDUAL:
        acc = _residual(res_ptr, offs_n, n_ok, N, acc, ROWS, R_PAD)
    _store_rows(out_ptr, offs_n, n_ok, N, acc, ROWS, R_PAD)
    if AUX:
        aux_slot = tl.load(aux_map + layer)
        if aux_slot >= 0:
            _store_rows(aux_ptr + aux_slot * (ROWS * N), offs_n, n_ok, N, acc, ROWS, R_PAD)
    _signal(cnt_ptr, done_index)


@triton.jit
def _gate_up_task(j, layer, cnt_ptr, wait_index, wait_target, done_index, x_ptr, w_layers, norm_ptr, eps, act_ptr,
                  H: tl.constexpr, INTER: tl.constexpr, ROWS: tl.constexpr, R_PAD: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    """Tile j of gate_up: SiLU(gate) * up of the normed x for intermediate columns tile, both rounded first."""
    offs_n = j * BN + tl.arange(0, BN)
    n_ok = offs_n < INTER
    w = w_layers + layer.to(tl.int64) * (2 * INTER * H)
    w0_gate = _weights(w, offs_n, n_ok, 0, H, BK)
    w0_up = _weights(w, INTER + offs_n, n_ok, 0, H, BK)
    _wait(cnt_ptr, wait_index, wait_target)
    rstd = _rstd(x_ptr, H, eps, ROWS, R_PAD, BK)
    gate = _gemv(x_ptr, w, offs_n, n_ok, H, w0_gate, rstd, norm_ptr, True, ROWS, R_PAD, BK)
    up = _gemv(x_ptr, w, INTER + offs_n, n_ok, H, w0_up, rstd, norm_ptr, True, ROWS, R_PAD, BK)
    gate = round_to(gate, act_ptr.dtype.element_ty).to(tl.float32)
    up = round_to(up, act_ptr.dtype.element_ty).to(tl.float32)
    _store_rows(act_ptr, offs_n, n_ok, INTER, gate / (1.0 + tl.exp(-gate)) * up, ROWS, R_PAD)
    _signal(cnt_ptr, done_index)


@triton.jit
def _final_norm(cnt_ptr, wait_index, wait_target, h_ptr, norm_ptr, out_ptr, eps, H: tl.constexpr, ROWS: tl.constexpr,
                R_PAD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    _wait(cnt_ptr, wait_index, wait_target)
    rstd = _rstd(h_ptr, H, eps, ROWS, R_PAD, BK)
    for n0 in range(0, H, BN):
        offs_n = n0 + tl.arange(0, BN)
        n_ok = offs_n < H
        _store_rows(out_ptr, offs_n, n_ok, H, _normed_columns(h_ptr, offs_n, n_ok, H, rstd, norm_ptr, ROWS, R_PAD),
                    ROWS, R_PAD)


@triton.jit
def decode_stack_kernel(
        h_ptr, ha_ptr, qkv_ptr, attn_ptr, act_ptr, out_ptr, cnt_ptr, sem_ptr, part_acc, part_m, part_l,
        w_qkv, b_qkv, w_o, w_gu, w_d, n_in, n_post, n_final,
        kc_ptr, vc_ptr, kv_layer_stride, cu_q, seq_lens, bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, aux_ptr, aux_map,
        eps, qk_scale, stride_bt, stride_blk, stride_pos, stride_kvh, stride_cos,
        LAYERS: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, NH: tl.constexpr, KVH: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLITS: tl.constexpr, SEQS: tl.constexpr,
        HAS_BIAS: tl.constexpr, AUX: tl.constexpr,
        ROWS: tl.constexpr, R_PAD: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
        BN_D: tl.constexpr, BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_D: tl.constexpr,
        PRECISION: tl.constexpr):
    """h [ROWS, H]: the embedded inputs, overwritten by each layer's output; out [ROWS, H]: the final norm's. A row is
    a token of one of SEQS sequences (cu_q); aux [slots, ROWS, H]: the outputs of the layers aux_map names."""
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
        base = layer * STAGES               # this layer's counters: base + stage
        if layer == LAYERS:                 # the final norm, once every layer is done
            _final_norm(cnt_ptr, base - 1, T_D, h_ptr, n_final, out_ptr, eps, H, ROWS, R_PAD, BN_O, BK_QKV)
        elif i < T_QKV:
            _matmul_task(i, layer, cnt_ptr, base - 1, T_D, base, h_ptr, w_qkv, NQKV, H, n_in + layer * H, eps, b_qkv,
                         qkv_ptr, qkv_ptr, aux_ptr, aux_map, True, HAS_BIAS, False, False, ROWS, R_PAD, BN_QKV,
                         BK_QKV)
        elif i < A1:
            _attention(i - T_QKV, layer, base, cnt_ptr, qkv_ptr, attn_ptr, kc_ptr, vc_ptr, kv_layer_stride, part_acc,
                       part_m, part_l, sem_ptr, cu_q, seq_lens, bt_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, qk_scale,
                       stride_bt, stride_blk, stride_pos, stride_kvh, stride_cos, T_QKV, NH, KVH, HEAD_DIM, HEAD_PAD,
                       GROUP, BLOCK_M, BLOCK_SIZE, TILE_N, SPLITS, SEQS, PRECISION)
            _signal(cnt_ptr, base + 1)
        elif i < A2:
            _matmul_task(i - A1, layer, cnt_ptr, base + 1, T_ATT, base + 2, attn_ptr, w_o, H, QS, n_in, eps, b_qkv,
                         h_ptr, ha_ptr, aux_ptr, aux_map, False, False, True, False, ROWS, R_PAD, BN_O, BK_O)
        elif i < A3:
            _gate_up_task(i - A2, layer, cnt_ptr, base + 2, T_O, base + 3, ha_ptr, w_gu, n_post + layer * H, eps,
                          act_ptr, H, INTER, ROWS, R_PAD, BN_GU, BK_GU)
        else:
            _matmul_task(i - A3, layer, cnt_ptr, base + 3, T_GU, base + 4, act_ptr, w_d, H, INTER, n_in, eps, b_qkv,
                         ha_ptr, h_ptr, aux_ptr, aux_map, False, False, True, AUX, ROWS, R_PAD, BN_D, BK_D)
    # the last program out resets every counter for the next launch
    tl.debug_barrier()
    exit_index = LAYERS * STAGES
    if tl.atomic_add(cnt_ptr + exit_index, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        for c0 in range(0, exit_index + 1, 256):
            offs = c0 + tl.arange(0, 256)
            tl.store(cnt_ptr + offs, tl.zeros([256], tl.int32), mask=offs <= exit_index)


@triton.jit
def _normed_columns(x_ptr, offs_n, n_ok, K, rstd, norm_ptr, ROWS: tl.constexpr, R_PAD: tl.constexpr):
    """The final norm of x's rows at columns offs_n, fp32 (rounded as the reference norm rounds)."""
    rows, r_ok = _rows(ROWS, R_PAD)
    x = tl.load(x_ptr + rows[:, None] * K + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0,
                cache_modifier=".cg")
    nw = tl.load(norm_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return round_to(x.to(tl.float32) * rstd[:, None], x.dtype).to(tl.float32) * nw[None, :]


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(decode_stack_kernel)
