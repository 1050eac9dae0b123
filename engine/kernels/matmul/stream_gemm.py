"""A matmul of a few rows over a large weight, the weight streamed over K on tensor cores.

    linear(x [MIN_ROWS <= M <= MAX_ROWS, K], weight [N, K]) -> [M, N]         (= F.linear(x, weight))

The decode GEMV holds whole weight rows of one x row at a time, and decode_gemm the whole of K in registers
(K <= 2048): both were made for small weights. A step of 2-64 rows over a 1-8B model's weights is a pure weight
read (the rows are a few KB, the weight tens of MB), which cuBLAS's skinny GEMMs do not run at the memory's pace.
Here each program owns BLOCK_N weight rows and walks K in BLOCK_K tiles, software-pipelined (NUM_STAGES loads in
flight), multiplying each tile by the rows' x tile on tensor cores with the weight as the MMA's M side (swap-AB:
the token rows are its N side, padded to BLOCK_M = 16-64 by masked rows, not to 64). BLOCK_N is small where N is,
so that N / BLOCK_N programs still fill the GPU.

Launched with programmatic dependent launch (engine/kernels/common.pdl), a program loads its first weight tile
before it waits for the kernel before it (weights never change during a step), then reads x.

The op before (RMSNorm, SiLU * up) and after (a residual add) stay separate kernels, as on the cuBLAS route.
Accumulation is fp32, rounded once to x.dtype; the summation order differs from cuBLAS, so results agree to
rounding, not bit for bit. Grid and constexprs depend only on shapes: every call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl
from engine.kernels.matmul import gemv_checks

MIN_ROWS, MAX_ROWS = 2, 64       # one row is the GEMV's; past 64 rows cuBLAS's tiles are full
MIN_K = 16                       # a tensor-core tile's K
MAX_K = 1 << 16                  # any model's K: the weight is streamed, not held
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _stream_gemm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_w, stride_out, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)          # weight rows: the output's columns
    rows = tl.arange(0, BLOCK_M)                          # token rows
    ks = tl.arange(0, BLOCK_K)
    col_ok, row_ok = cols < N, rows < M
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_w + ks[None, :]
    x_ptrs = x_ptr + rows[None, :] * stride_x + ks[:, None]
    # the first weight tile before the wait: the weight does not depend on the kernel before
    w = tl.load(w_ptrs, mask=col_ok[:, None] & (ks[None, :] < K), other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    xt = tl.load(x_ptrs, mask=row_ok[None, :] & (ks[:, None] < K), other=0.0)
    acc = tl.dot(w, xt.to(w.dtype), out_dtype=tl.float32, input_precision=PRECISION)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & (ks[None, :] + k0 < K), other=0.0)
        xt = tl.load(x_ptrs + k0, mask=row_ok[None, :] & (ks[:, None] + k0 < K), other=0.0)
        acc += tl.dot(w, xt.to(w.dtype), out_dtype=tl.float32, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[None, :] * stride_out + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


def interpreted() -> bool:
    """True when the kernel was built for Triton's CPU interpreter."""
    return is_interpreted(_stream_gemm_kernel)


def problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why this kernel cannot take x @ weight.T, or None where it can: its own conditions (a tensor-core tile of K,
    a float dtype), then those it shares with the decode GEMV (gemv_checks.problem)."""
    if x.dim() == 2 and weight.dim() == 2 and (x.shape[1] != weight.shape[1] or x.shape[1] < MIN_K):
        return f"K must match and be at least {MIN_K}"
    if x.dtype != weight.dtype or x.dtype not in DTYPES:
        return "x and weight must share a float dtype"
    return gemv_checks.problem(x, weight, x.shape[1], rows=(MIN_ROWS, MAX_ROWS), max_k=MAX_K)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return problem(x, weight) is None


def config(m: int, n: int, k: int) -> dict:
    """Launch constants by shape: at least ~2 programs an SM where N allows (BLOCK_N 16-64), K in 128-256 tiles."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = 16 if n <= 4096 else 32 if n <= 16384 else 64
    block_k = 256 if block_m <= 32 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, max(MIN_K, triton.next_power_of_2(k))),
                NUM_STAGES=4, num_warps=4)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for 2-64 rows; ValueError naming the reason where this kernel cannot take it."""
    why = problem(x, weight)
    if why is not None:
        raise ValueError(f"stream_gemm.linear: {why}")
    m, k = x.shape
    n = weight.shape[0]
    cfg = config(m, n, k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    precision = "ieee" if weight.dtype == torch.float32 else "tf32"     # tf32 would round float32 inputs
    _stream_gemm_kernel[grid](x, weight, out, x.stride(0), weight.stride(0), out.stride(0), m, n, k, **cfg,
                              PRECISION=precision, **pdl(_stream_gemm_kernel, x.device, m))
    return out
