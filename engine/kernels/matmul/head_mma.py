"""A greedy step's LM head and argmax for a few rows on tensor cores, without logits.

    linear_argmax(x [M <= MAX_ROWS, K], weight [V, K]) -> int64 [M]     (= F.linear(x, weight).float().argmax(-1))
    with ids [V] int64: ids[that argmax] (a draft vocabulary)

On the "cublas" head route (engine/kernels/routes.py) a greedy step's tokens are cuBLAS's [M, V] logits, then
argmax.py's two kernels: a GEMM of few, large tiles, then the block max.
Here each program takes BLOCK_V vocabulary rows on the MMA's M side and all of the step's rows on its N side (a
swapped GEMM: no row count is padded to 64), loops over K in BLOCK_K chunks, and keeps only each row's largest
logit of its block and that logit's first vocabulary row; argmax.first_max then reduces those partials, as after
the decode GEMV's argmax epilogue. Smaller tiles than cuBLAS's put more programs, and more loads, on each SM: alone
it takes less time a call than cuBLAS + argmax at 1-32 rows (docs/decode_step.md).

Logits are compared as the dtype rounds them (as F.linear's output), NaN above every number, the first maximal
row winning, as in draft_gemv.py. The summation order differs from cuBLAS, so on a GPU a near-tie may pick another
token than the torch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, round_to
from engine.kernels.matmul import gemv_checks
from engine.kernels.sampling import argmax

MAX_ROWS = 64           # the step's rows sit on the MMA's N side, one tile of up to 64
MAX_K = 16384
_LIMITS = dict(rows=(1, MAX_ROWS), max_k=MAX_K)


@triton.jit
def _head_mma_kernel(x_ptr, w_ptr, val_ptr, idx_ptr, stride_x, P, M, V, K, BLOCK_V: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """val[m, pid], idx[m, pid] = the largest of y[m, rows] and its first row, for y = x @ weight.T rounded to the
    dtype and this program's BLOCK_V vocabulary rows (masked rows at -inf, NaN as +inf). PRELOAD: the first
    weight chunk is read before the dependent-launch wait (it does not depend on the kernel before)."""
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    rows = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = rows < V
    toks = tl.arange(0, BLOCK_T)
    t_ok = toks < M
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + toks[None, :] * stride_x + offs_k[:, None]
    acc = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
    if PRELOAD:
        w = tl.load(w_ptrs, mask=v_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        pdl_start(USE_PDL)
        for k0 in range(0, K, BLOCK_K):
            xt = tl.load(x_ptrs + k0, mask=(k0 + offs_k < K)[:, None] & t_ok[None, :], other=0.0)
            acc = _dot(w, xt, acc, UPCAST, PRECISION)
            w = tl.load(w_ptrs + k0 + BLOCK_K, mask=v_ok[:, None] & (k0 + BLOCK_K + offs_k < K)[None, :], other=0.0)
    else:
        pdl_start(USE_PDL)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + offs_k < K
            w = tl.load(w_ptrs + k0, mask=v_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs + k0, mask=k_ok[:, None] & t_ok[None, :], other=0.0)
            acc = _dot(w, xt, acc, UPCAST, PRECISION)
    argmax.store_block_max(round_to(acc, dtype), rows, v_ok, V, toks, t_ok, P, pid, val_ptr, idx_ptr)


@triton.jit
def _dot(w, xt, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:      # the interpreter has no bf16 product: fp32 operands hold the bf16 values exactly
        w, xt = w.to(tl.float32), xt.to(tl.float32)
    return tl.dot(w, xt, acc, input_precision=PRECISION)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_head_mma_kernel) and argmax.interpreted()


def head_config(m: int, v: int, k: int) -> dict:
    """Launch parameters by shape (a bench may replace this function)."""
    return dict(BLOCK_V=128, BLOCK_K=64, PRELOAD=False, num_warps=4, num_stages=3)


def block_t(m: int) -> int:
    """The kernel's BLOCK_T for m rows: the MMA's N side, a power of two of at least 16."""
    return max(16, triton.next_power_of_2(m))


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear_argmax takes a call; a caller computes the logits and their argmax otherwise."""
    return gemv_checks.problem(x, weight, x.shape[-1], **_LIMITS) is None


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight).float().argmax(-1) in two kernels: x [M <= MAX_ROWS, K] (unit stride in K), weight
    [V, K] contiguous, of x's dtype. Returns int64 [M], the first maximal row on ties (ids[that row] with ids
    [V] int64)."""
    gemv_checks.check(x, weight, **_LIMITS)
    argmax.check_ids(ids, weight.shape[0], x.device)
    return first_max(*partials(x, weight), ids)


def partials(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None):
    """The kernel on checked inputs -> (val [M, P] fp32, idx [M, P] int32): each program's largest logit of
    each row and its first vocabulary row."""
    (m, k), v = x.shape, weight.shape[0]
    cfg = dict(config or head_config(m, v, k))
    block_v = cfg.pop("BLOCK_V")
    p = triton.cdiv(v, block_v)
    val = torch.empty((m, p), dtype=torch.float32, device=x.device)
    idx = torch.empty((m, p), dtype=torch.int32, device=x.device)
    upcast = x.dtype == torch.bfloat16 and interpreted()
    _head_mma_kernel[(p,)](x, weight, val, idx, x.stride(0), p, m, v, k, BLOCK_V=block_v,
                           BLOCK_T=block_t(m), UPCAST=upcast,
                           PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", **cfg,
                           **pdl(_head_mma_kernel, x.device, m))
    return val, idx


def first_max(val: torch.Tensor, idx: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The partials' first maximal vocabulary row a step row (argmax.first_max)."""
    return argmax.first_max(val, idx, torch.empty(val.shape[0], dtype=torch.int64, device=val.device), ids)
