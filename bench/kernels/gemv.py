"""Small-M GEMV kernels for the decode step, with the op before the matmul fused into its prologue: the first GEMVs,
kept for bench/kernels/gemv_kernels.py (the engine runs engine/kernels/matmul/decode_gemv.py).

    norm_linear(x, norm_weight, eps, weight, bias=None, residual=None) -> (out, new_residual)
        = F.linear(rms_norm(x [+ residual]), weight, bias), rounding as engine.kernels.fused_ops.rms_norm_ref
    silu_mul_linear(gate_up, weight) -> F.linear(silu(gate) * up, weight)   (as fused_ops.silu_mul_ref)
    linear(x, weight, bias=None)     -> F.linear(x, weight, bias)

x has M <= MAX_ROWS rows; weight is nn.Linear's contiguous [N, K]. One program owns BLOCK_N output
columns for all rows and walks K in BLOCK_K chunks: it recomputes the prologue on its [M, BLOCK_K] chunk
of x (x is tiny next to the weight, and sits in L2) and multiplies it by its [BLOCK_N, BLOCK_K] weight
tile. For norm_linear every program first makes its own pass over x for the rows' sum of squares, so no
second kernel is needed; program 0 also stores the new residual. The weight is read exactly once, which
is what the step costs at small M.

Why tl.dot with rows padded to BLOCK_M = 16 (the smallest tile tl.dot takes) rather than a broadcast
multiply-and-sum: the weight stream is the bottleneck, the padded MMA is free next to it, and one code
path serves M = 1..16 (a broadcast-sum needs M accumulators of [BLOCK_N, BLOCK_K] and turns FMA-bound
at M = 16). No split-K: it would need a second launch or atomics plus a zeroed buffer, which costs what
the fusion saves; small N gets small BLOCK_N instead (gemv_config).

Accumulation is fp32, rounded once to x.dtype (bias added in fp32 first). fp32 inputs use exact "ieee"
products. Grids and constexprs depend only on shapes: every entry point can be captured in a CUDA graph.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_sum
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_same, _check_tensor, rms_norm_ref, silu_mul_ref

MAX_ROWS = 16  # rows per call; the kernels pad M to this for tl.dot (M > 16: use the *_ref / cuBLAS path)
_BLOCK_M = 16


@triton.jit
def _load_h(x_ptr, res_ptr, stride_x, stride_res, offs_m, offs_k, ok, HAS_RESIDUAL: tl.constexpr):
    """x [+ residual] chunk, the sum rounded to the dtype (it is the next residual, and what the norm reads)."""
    h = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_res + offs_k[None, :], mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def _rstd(x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, eps, HAS_RESIDUAL: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    sq = tl.full((BLOCK_M, BLOCK_K), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ok = m_ok[:, None] & (offs_k[None, :] < K)
        hf = _load_h(x_ptr, res_ptr, stride_x, stride_res, offs_m, offs_k, ok, HAS_RESIDUAL).to(tl.float32)
        sq += hf * hf
    return tl.rsqrt(reduce_sum(sq, 1) / K + eps)


@triton.jit
def _gemv_kernel(x_ptr, nw_ptr, res_ptr, w_ptr, b_ptr, out_ptr, new_res_ptr, stride_x, stride_res,
                 stride_out, stride_new_res, M, N, K, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """PROLOGUE "none": A = x; "norm": A = rms_norm(x [+ res]); "silu": A = silu(x[:, :K]) * x[:, K:].
    out[M, N] = A @ w.T (+ b). Padded rows and columns load zeros, so they add nothing."""
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    if PROLOGUE == "norm":
        rstd = _rstd(x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, eps, HAS_RESIDUAL, BLOCK_M, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        ok = m_ok[:, None] & k_ok[None, :]
        if PROLOGUE == "norm":
            h = _load_h(x_ptr, res_ptr, stride_x, stride_res, offs_m, offs_k, ok, HAS_RESIDUAL)
            if HAS_RESIDUAL:
                if pid == 0:
                    tl.store(new_res_ptr + offs_m[:, None] * stride_new_res + offs_k[None, :], h, mask=ok)
            # Two roundings, as RMSNorm: normed to the dtype, then the same-dtype weight multiply (the
            # product of two bf16/fp16 values is exact in fp32, so rounding it matches torch's multiply).
            normed = (h.to(tl.float32) * rstd[:, None]).to(dtype)
            nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            a = (nw[None, :] * normed.to(tl.float32)).to(dtype)
        elif PROLOGUE == "silu":
            g = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + offs_m[:, None] * stride_x + K + offs_k[None, :], mask=ok, other=0.0)
            a = (g / (1.0 + tl.exp(-g)) * u.to(tl.float32)).to(dtype)
        else:
            a = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=ok, other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns; exact in fp32 (ieee) instead
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], acc.to(dtype),
             mask=m_ok[:, None] & n_ok[None, :])


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_gemv_kernel)


def gemv_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Launch parameters by shape (no autotuning, so the choice is fixed and graph-capturable).

    BLOCK_N grows from 16 only while the grid keeps >= ~2 programs per H100 SM: small N (qkv, down of
    small models) needs many programs to pull the weight at full bandwidth. BLOCK_K keeps the weight
    tile at ~8 KiB per pipeline stage.
    """
    block_n = 16
    while block_n < 64 and triton.cdiv(n, 2 * block_n) >= 256:
        block_n *= 2
    block_k = max(32, min(256, 8192 // (block_n * dtype.itemsize), triton.next_power_of_2(k)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)


def _check_device(device):
    if device.type != "cuda" and not interpreted():
        raise ValueError(f"tensors on {device} need a CUDA device or the Triton interpreter (TRITON_INTERPRET=1 "
                         "before triton is imported)")


def _check_rows(name, x):
    _check_tensor(name, x, 2, _FLOAT_DTYPES)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{name} has {x.shape[0]} rows; these kernels take at most MAX_ROWS={MAX_ROWS}")


def _check_weight(weight, x, k):
    _check_tensor("weight", weight, 2, _FLOAT_DTYPES, x.device)
    _check_same("weight", weight, "x", x, shape=False)
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [N, K], got strides {weight.stride()}")
    if weight.shape[1] != k:
        raise ValueError(f"weight is {tuple(weight.shape)}, expected [N, {k}]")
    if weight.shape[0] == 0 or k == 0:
        raise ValueError(f"weight must be non-empty, got shape {tuple(weight.shape)}")


def _check_vector(name, v, size, x):
    _check_tensor(name, v, 1, _FLOAT_DTYPES, x.device)
    _check_same(name, v, "x", x, shape=False)
    if v.shape[0] != size:
        raise ValueError(f"{name} has {v.shape[0]} elements, expected {size}")


def _launch(x, weight, prologue, k, nw=None, eps=0.0, bias=None, residual=None):
    """out = prologue(x) @ weight.T (+ bias); returns (out, new_res) (new_res is x unless a residual)."""
    _check_device(x.device)
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if m:
        res = x if residual is None else residual
        cfg = gemv_config(m, n, k, x.dtype)
        upcast = x.dtype == torch.bfloat16 and interpreted()
        _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x, x if nw is None else nw, res, weight, weight if bias is None else bias, out, new_res,
            x.stride(0), res.stride(0), out.stride(0), new_res.stride(0), m, n, k, float(eps),
            PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M,
            PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast, **cfg,
            **pdl(_gemv_kernel, x.device, m))
    return out, new_res


def norm_linear(x, norm_weight, eps, weight, bias=None, residual=None):
    """F.linear(rms_norm_ref(x, norm_weight, eps, residual), weight, bias) for x [M <= MAX_ROWS, K].

    Returns (out [M, N], new_residual): new_residual is h = (x + residual) rounded to the dtype (a new
    tensor) with a residual, else x itself. x and residual rows may be strided (unit stride in K).
    """
    _check_rows("x", x)
    _check_vector("norm_weight", norm_weight, x.shape[1], x)
    if isinstance(eps, torch.Tensor) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a host float, got {type(eps).__name__}")
    if residual is not None:
        _check_tensor("residual", residual, 2, _FLOAT_DTYPES, x.device)
        _check_same("residual", residual, "x", x)
    _check_weight(weight, x, x.shape[1])
    if bias is not None:
        _check_vector("bias", bias, weight.shape[0], x)
    return _launch(x, weight, "norm", x.shape[1], nw=norm_weight, eps=eps, bias=bias, residual=residual)


def norm_linear_ref(x, norm_weight, eps, weight, bias=None, residual=None):
    """Pure-torch norm_linear (same semantics, any device, any M)."""
    if residual is None:
        return F.linear(rms_norm_ref(x, norm_weight, eps), weight, bias), x
    normed, h = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(normed, weight, bias), h


def silu_mul_linear(gate_up, weight):
    """F.linear(silu_mul_ref(gate_up), weight): gate_up [M <= MAX_ROWS, 2*I] (gate, then up), weight [N, I]."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up halves), got {gate_up.shape[1]}")
    _check_weight(weight, gate_up, gate_up.shape[1] // 2)
    return _launch(gate_up, weight, "silu", gate_up.shape[1] // 2)[0]


def silu_mul_linear_ref(gate_up, weight):
    """Pure-torch silu_mul_linear (same semantics, any device, any M)."""
    return F.linear(silu_mul_ref(gate_up), weight)


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) for x [M <= MAX_ROWS, K], weight [N, K] contiguous."""
    _check_rows("x", x)
    _check_weight(weight, x, x.shape[1])
    if bias is not None:
        _check_vector("bias", bias, weight.shape[0], x)
    return _launch(x, weight, "none", x.shape[1], bias=bias)[0]


def linear_ref(x, weight, bias=None):
    """Pure-torch linear (F.linear)."""
    return F.linear(x, weight, bias)
