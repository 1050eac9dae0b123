"""A matmul of a few rows over a large weight, the weight streamed over K on tensor cores.

    linear(x [MIN_ROWS <= M <= MAX_ROWS, K], weight [N, K]) -> [M, N]         (= F.linear(x, weight))
    norm_linear(x, norm_weight, eps, weight, residual=None) -> (out, new_residual)
                                                  (= F.linear(fused_ops.rms_norm(...), weight))
    norm_linear_silu(x, norm_weight, eps, gate_up_weight, residual=None) -> (act, new_residual)
                                                  (= fused_ops.silu_mul(norm_linear(...)[0]))

The decode GEMV holds whole weight rows of one x row at a time, and decode_gemm the whole of K in registers
(K <= 2048): both were made for small weights. A step of 2-64 rows over a 1-8B model's weights is a pure weight
read (the rows are a few KB, the weight tens of MB), which cuBLAS's skinny GEMMs do not run at the memory's pace.
Here each program owns BLOCK_N weight rows and walks K in BLOCK_K tiles, software-pipelined (NUM_STAGES loads in
flight), multiplying each tile by the rows' x tile on tensor cores with the weight as the MMA's M side (swap-AB:
the token rows are its N side, padded to BLOCK_M = 16-64 by masked rows, not to 64). BLOCK_N is 64 where N leaves
enough programs (config).

Launched with programmatic dependent launch (engine/kernels/common.pdl), a program loads its first weight tile
before it waits for the kernel before it (weights never change during a step), then reads x. With
SPECDEC_L2_AHEAD=1 (on Hopper) it first starts its whole weight slice on its way into L2.

The residual add and RMSNorm before qkv and gate_up run inside it, and SiLU * up after gate_up, so that a layer is
five kernels as on the decode GEMV's route, not eight as on cuBLAS's: the tiles of x carry norm_weight * (x +
residual) into the MMA while the loop sums each row's squares, and each row's 1 / rms scales the product after the
loop (a row's scale commutes with the matmul). The program of the first weight rows stores the new residual.
With "silu_mul" a program's weight rows are gate and up rows in pairs (silu_pairs.py), and it stores
silu(gate) * up. Accumulation is fp32, rounded once to x.dtype. The summation order and the norm's rounding
(norm_weight * h rounded once, where rms_norm rounds h / rms and then its product) differ from the separate
kernels, so results agree to rounding, not bit for bit. Grid and constexprs depend only on shapes: every call can
be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import (is_interpreted, l2_ahead, l2_prefetch, pdl, reduce_sum, round_to,
                                   shared_memory_bytes, sm_count, unit_stride)
from engine.kernels.matmul import gemv_checks
from engine.kernels.matmul.silu_pairs import block_rows, out_columns, pairs_fit, silu_store
from engine.kernels.matmul.split_k import store_partial, sum_partials

MIN_ROWS, MAX_ROWS = 2, 64       # one row is the GEMV's; past 64 rows cuBLAS's tiles are full
MIN_K = 16                       # a tensor-core tile's K
MAX_K = 1 << 16                  # any model's K: the weight is streamed, not held
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMEM_SPARE = 16 << 10            # shared memory the compiler takes beyond the pipeline's tiles (layout changes)
VARIANTS = ("base", "wide", "narrow", "split")   # launch shapes (config); routes name them stream, stream_wide, ...
MAX_SPLITS = 8                   # "split": programs a tile at most
INTERPRETED_SMS = 132            # the SMs "split" fills where there are none (the CPU interpreter)


@triton.jit
def _a_tile(x_ptr, res_ptr, nw_ptr, new_res_ptr, stride_x, stride_res, stride_new_res, rows, row_ok, kk, K, stored,
            PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """x's tile [BLOCK_K, BLOCK_M] as the MMA takes it, and each row's sum of squares of h (x [+ residual], the
    norm's input) over the tile (0 without the norm). With the "norm" prologue the tile is norm_weight * h, each
    row's 1 / rms applied to the product after the loop; this program writes the new residual h of the rows below
    `stored` (M or 0)."""
    ok = (kk < K)[:, None] & row_ok[None, :]
    h = tl.load(x_ptr + rows[None, :] * stride_x + kk[:, None], mask=ok, other=0.0)
    if PROLOGUE == "norm":
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[None, :] * stride_res + kk[:, None], mask=ok, other=0.0)
            h = round_to(h.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
            tl.store(new_res_ptr + rows[None, :] * stride_new_res + kk[:, None], h, mask=ok & (rows < stored)[None, :])
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0)
        hf = h.to(tl.float32)
        a, sq = round_to(nw.to(tl.float32)[:, None] * hf, x_ptr.dtype.element_ty), reduce_sum(hf * hf, 0)
    else:
        a, sq = h, 0.0
    return a, sq


@triton.jit
def _slice_to_l2(w_ptr, stride_w, pid, N, BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr):
    """The program's whole weight slice on its way into L2 before the wait, so that the loop after it reads L2
    where the kernel before left HBM idle: one bulk prefetch a run of contiguous rows (gate's and up's with
    "silu_mul"). Rows are stride_w elements apart, their bytes a multiple of 16 (the launch checks)."""
    size: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    if EPILOGUE == "silu_mul":
        first = pid * (BLOCK_N // 2)
        count = tl.minimum(BLOCK_N // 2, N - first)
        l2_prefetch(w_ptr + first.to(tl.int64) * stride_w, count * stride_w * size)
        l2_prefetch(w_ptr + (first + N).to(tl.int64) * stride_w, count * stride_w * size)
    else:
        first = pid * BLOCK_N
        count = tl.minimum(BLOCK_N, N - first)
        l2_prefetch(w_ptr + first.to(tl.int64) * stride_w, count * stride_w * size)


@triton.jit
def _stream_gemm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, new_res_ptr, part_ptr, cnt_ptr, stride_x, stride_res,
                        stride_w, stride_out, stride_new_res, M, N, K, K_SPLIT, eps, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, SPLITS: tl.constexpr,
                        USE_PDL: tl.constexpr, PRECISION: tl.constexpr, L2_AHEAD: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    offs_n, n_ok = block_rows(pid, N, BLOCK_N, EPILOGUE)  # weight rows ("silu_mul": gate and up rows in pairs)
    if L2_AHEAD:
        _slice_to_l2(w_ptr, stride_w, pid, N, BLOCK_N, EPILOGUE)
    rows = tl.arange(0, BLOCK_M)                          # token rows
    row_ok = rows < M
    ks = split * K_SPLIT + tl.arange(0, BLOCK_K)          # this program's K range (all of K but with SPLITS)
    k_end = tl.minimum(K, split * K_SPLIT + K_SPLIT)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + ks[None, :]
    # the first weight tile before the wait: the weight does not depend on the kernel before
    w = tl.load(w_ptrs, mask=n_ok[:, None] & (ks[None, :] < k_end), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    stored = tl.where(pid == 0, M, 0)      # the first weight rows' programs store the new residual
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    a, sq = _a_tile(x_ptr, res_ptr, nw_ptr, new_res_ptr, stride_x, stride_res, stride_new_res, rows, row_ok, ks,
                    k_end, stored, PROLOGUE, HAS_RESIDUAL)
    ss += sq
    acc = tl.dot(w, a.to(w.dtype), out_dtype=tl.float32, input_precision=PRECISION)
    for k0 in tl.range(BLOCK_K, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & (ks[None, :] + k0 < k_end), other=0.0)
        a, sq = _a_tile(x_ptr, res_ptr, nw_ptr, new_res_ptr, stride_x, stride_res, stride_new_res, rows, row_ok,
                        ks + k0, k_end, stored, PROLOGUE, HAS_RESIDUAL)
        ss += sq
        acc += tl.dot(w, a.to(w.dtype), out_dtype=tl.float32, input_precision=PRECISION)
    if SPLITS > 1:      # the tile's last split program to finish sums the partials and ends the tile
        if store_partial(acc, ss, part_ptr, cnt_ptr, pid, split, BLOCK_M, BLOCK_N) == SPLITS - 1:
            acc, ss = sum_partials(part_ptr, cnt_ptr, pid, BLOCK_M, BLOCK_N, SPLITS)
            _end(acc, ss, out_ptr, rows, row_ok, offs_n, n_ok, stride_out, pid, N, K, eps, PROLOGUE, EPILOGUE,
                 BLOCK_M, BLOCK_N)
    else:
        _end(acc, ss, out_ptr, rows, row_ok, offs_n, n_ok, stride_out, pid, N, K, eps, PROLOGUE, EPILOGUE, BLOCK_M,
             BLOCK_N)


@triton.jit
def _end(acc, ss, out_ptr, rows, row_ok, offs_n, n_ok, stride_out, pid, N, K, eps, PROLOGUE: tl.constexpr,
         EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's end: each row's 1 / rms after the norm prologue, rounded once, then stored (or SiLU * up)."""
    if PROLOGUE == "norm":
        acc = acc * tl.rsqrt(tl.where(row_ok, ss / K + eps, 1.0))[None, :]     # padded rows stay finite
    y = round_to(acc, out_ptr.dtype.element_ty)
    if EPILOGUE == "silu_mul":
        silu_store(out_ptr, tl.trans(y), rows, row_ok, stride_out, N, pid, BLOCK_M, BLOCK_N)
    else:
        tl.store(out_ptr + rows[None, :] * stride_out + offs_n[:, None], y, mask=n_ok[:, None] & row_ok[None, :])


def interpreted() -> bool:
    """True when the kernel was built for Triton's CPU interpreter."""
    return is_interpreted(_stream_gemm_kernel)


def problem(x: torch.Tensor, weight: torch.Tensor, norm_weight=None, residual=None, silu: bool = False,
            variant: str = "base", counters=None) -> str | None:
    """Why this kernel cannot take x @ weight.T (with the norm before it where norm_weight is given, SiLU * up
    after it where silu), or None where it can: its own conditions (a tensor-core tile of K, a float dtype, an even
    [gate; up]; for "split", K long enough for two splits and a counter a tile), then those it shares with the
    decode GEMV (gemv_checks.problem)."""
    if x.dim() == 2 and weight.dim() == 2 and (x.shape[1] != weight.shape[1] or x.shape[1] < MIN_K):
        return f"K must match and be at least {MIN_K}"
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        return "x and weight must share a float dtype"
    if silu and not pairs_fit(weight):
        return f"weight {tuple(weight.shape)} must be [gate; up] with an even N"
    why = gemv_checks.problem(x, weight, x.shape[1], norm_weight, residual, rows=(MIN_ROWS, MAX_ROWS), max_k=MAX_K)
    if why is None and variant == "split":
        cfg = config(x.shape[0], weight.shape[0], x.shape[1], variant="split", sms=_sms(x.device))
        return _split_problem(weight, silu, counters, cfg, x.device)
    return why


def _split_problem(weight, silu: bool, counters, cfg: dict, device) -> str | None:
    """Why the split launch of config `cfg` cannot run over `weight`, or None."""
    if cfg["SPLITS"] < 2:
        return f"K = {weight.shape[1]} over {weight.shape[0]} rows leaves no room for two splits"
    tiles = out_columns(weight.shape[0], cfg["BLOCK_N"], "silu_mul" if silu else "store")[1]
    if counters is None or counters.dtype != torch.int32 or counters.dim() != 1 or counters.device != device \
            or not unit_stride(counters):        # tile i's counter is at offset i
        return f"split needs a 1-D int32 counter buffer on {device}, with unit stride"
    if counters.numel() < tiles:
        return f"split needs {tiles} counters, the buffer holds {counters.numel()}"
    return None


def supports(x: torch.Tensor, weight: torch.Tensor, norm_weight=None, residual=None, silu: bool = False,
             variant: str = "base", counters=None) -> bool:
    return problem(x, weight, norm_weight, residual, silu, variant, counters) is None


def _sms(device: torch.device) -> int:
    return sm_count(device) if device.type == "cuda" else INTERPRETED_SMS


def config(m: int, n: int, k: int, elem: int = 2, x_tiles: int = 1, smem: int = 1 << 30,
           variant: str = "base", sms: int = INTERPRETED_SMS) -> dict:
    """Launch constants by shape and VARIANTS' variant. "base": 64 weight rows a program where N leaves 32
    programs or more (fewer, longer programs repeat the prologue less and keep more bytes in flight each), K in
    256-element tiles at 16 token rows and 128 past them, four warps. "wide": twice base's weight rows (at most
    128), 128-element K tiles and eight warps: a large gate_up, whose pairs' prologue would repeat over many narrow
    programs. "narrow": 16 weight rows and 256-element K tiles, four times the programs: a smaller weight without a
    prologue, whose few base programs leave SMs idle. "split": base's tiles with K split over SPLITS programs a
    tile, as many as the `sms` SMs hold in one wave (a program takes an SM's shared memory; at most MAX_SPLITS,
    each at least two K tiles long, K_SPLIT elements): a weight
    of few base programs with a long K, each SM keeping a whole pipeline of base's tiles in flight, at the cost of
    the partials' sum by the tile's last program. Which one a matmul takes is measured (engine/kernels/tune.py).
    All start at four stages; then fewer stages, then shorter K tiles, until the pipeline's buffers and the
    epilogue's float32 tile fit `smem` bytes (`elem` bytes an element; `x_tiles`: tiles of x a stage loads, 2 with a
    residual)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown stream_gemm variant {variant!r}; choose from {VARIANTS}")
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 64 if n >= 2048 else 32 if n >= 1024 else 16
    block_k, warps = (256 if block_m <= 16 else 128), 4
    if variant == "wide":
        block_n, block_k, warps = min(128, 2 * block_n), 128, 8
    elif variant == "narrow":
        block_n, block_k = 16, 256
    block_k = min(block_k, max(MIN_K, triton.next_power_of_2(k)))
    stages = 4

    # the stages' weight and x tiles, the MMA's operand of x, and the epilogue's float32 tile
    def need(stages, block_k):
        return elem * block_k * (stages * (block_n + x_tiles * block_m) + block_m) + 4 * block_n * block_m
    while need(stages, block_k) > smem and (stages > 2 or block_k > MIN_K):
        stages, block_k = (stages - 1, block_k) if stages > 2 else (stages, block_k // 2)
    splits, k_split = 1, k
    if variant == "split":
        splits = min(MAX_SPLITS, sms // triton.cdiv(n, block_n), k // (2 * block_k))
        k_split = triton.cdiv(triton.cdiv(k, max(splits, 1)), block_k) * block_k
        splits = triton.cdiv(k, k_split)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, num_warps=warps,
                SPLITS=splits, K_SPLIT=k_split)


def _launch(name: str, x, weight, norm_weight=None, eps: float = 0.0, residual=None, epilogue: str = "store",
            variant: str = "base", counters=None):
    """The kernel -> (out, new_residual); ValueError naming the reason where it cannot take the call."""
    silu = epilogue == "silu_mul"
    why = problem(x, weight, norm_weight, residual, silu)       # the checks every launch shape shares
    if why is None:
        m, k = x.shape
        cfg = config(m, weight.shape[0], k, x.element_size(), 1 + (residual is not None),
                     shared_memory_bytes(x.device) - SMEM_SPARE, variant=variant, sms=_sms(x.device))
        if variant == "split":                  # checked on the config that runs, computed once
            why = _split_problem(weight, silu, counters, cfg, x.device)
    if why is not None:
        raise ValueError(f"stream_gemm.{name}: {why}")
    k_split = cfg.pop("K_SPLIT")
    n, grid = out_columns(weight.shape[0], cfg["BLOCK_N"], epilogue)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = x if residual is None else residual
    new_res = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    part = out if cfg["SPLITS"] == 1 else torch.empty(     # each split's tile and its rows' sums of squares
        cfg["SPLITS"] * grid * (cfg["BLOCK_N"] + 1) * cfg["BLOCK_M"], dtype=torch.float32, device=x.device)
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"     # tf32 would round float32 inputs
    ahead = (l2_ahead(_stream_gemm_kernel, x.device) and weight.data_ptr() % 16 == 0
             and weight.stride(0) * weight.element_size() % 16 == 0)
    _stream_gemm_kernel[(grid, cfg["SPLITS"])](
        x, res, x if norm_weight is None else norm_weight, weight, out, new_res, part,
        out if counters is None else counters, x.stride(0), res.stride(0), weight.stride(0), out.stride(0),
        new_res.stride(0), m, n, k, k_split, float(eps), PROLOGUE="none" if norm_weight is None else "norm",
        HAS_RESIDUAL=residual is not None, EPILOGUE=epilogue, **cfg, PRECISION=precision, L2_AHEAD=ahead,
        **pdl(_stream_gemm_kernel, x.device, m))
    return out, new_res


def linear(x: torch.Tensor, weight: torch.Tensor, variant: str = "base", counters=None) -> torch.Tensor:
    """x @ weight.T for 2-64 rows (`variant`: config's launch shape; "split" takes a zeroed int32 counter buffer of
    a counter a tile, which each launch leaves zeroed)."""
    return _launch("linear", x, weight, variant=variant, counters=counters)[0]


def norm_linear(x, norm_weight, eps: float, weight, residual=None, variant: str = "base", counters=None):
    """F.linear(fused_ops.rms_norm(x, norm_weight, eps, residual), weight) in one kernel. Returns (out,
    new_residual): with a residual, h = x + residual rounded to the dtype (a new tensor), else x itself."""
    return _launch("norm_linear", x, weight, norm_weight, eps, residual, variant=variant, counters=counters)


def norm_linear_silu(x, norm_weight, eps: float, weight, residual=None, variant: str = "base", counters=None):
    """fused_ops.silu_mul(norm_linear(...)[0]) in one kernel, for weight = [gate; up] ([2 * I, K]). Returns
    (act [M, I], new_residual) as norm_linear's."""
    return _launch("norm_linear_silu", x, weight, norm_weight, eps, residual, epilogue="silu_mul", variant=variant,
                   counters=counters)
