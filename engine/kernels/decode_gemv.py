"""Matmuls of a decode step with a few rows: out = x @ weight.T, the weight loaded before the wait.

    decode_linear(x [M <= MAX_ROWS, K], weight [N, K]) -> [M, N]        (= F.linear(x, weight))

At one stream a decode step's matmuls read 7 MB of weights per SmolLM2 layer in ~4 µs kernels whose bandwidth
floor is ~0.5 µs: they are latency, not bandwidth. Each program here owns BLOCK_N whole weight rows and loads
them into registers first. Launched with programmatic dependent launch (engine/kernels/common.pdl), that load
runs while the kernel before it (the norm, the attention, SiLU * up) is still finishing, since weights never
change during a step. Only then does it wait (gdc_wait) and read x, so what remains after the dependency is an
L2 read of x, a row reduction and a store. Without PDL it is a plain GEMV.

Accumulation is fp32 (exact products for fp32 inputs), rounded once to x.dtype; the summation order differs
from cuBLAS, so results agree to rounding, not bit for bit. The grid and constexprs depend only on shapes, so
every call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, reduce_sum
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_same, _check_tensor

MAX_ROWS = 4            # more rows: cuBLAS (each row here is its own pass over the registers)
MAX_K = 8192            # a whole weight row sits in registers
_ELEMS = 8192           # weight elements per program (BLOCK_N x BLOCK_K): 64 per thread at 4 warps


@triton.jit
def _decode_gemv_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, M, N, K, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    # the weights do not depend on the kernel before: read them before waiting for it
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for m in range(M):
        x = tl.load(x_ptr + m * stride_x + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc = reduce_sum(w * x[None, :], 1)
        tl.store(out_ptr + m * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_decode_gemv_kernel)


def decode_gemv_config(n: int, k: int) -> dict:
    """BLOCK_K: the whole row (a power of two); BLOCK_N: as many rows as fit _ELEMS, at least one."""
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(_ELEMS // block_k, triton.next_power_of_2(n)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4 if block_k <= 2048 else 8)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether decode_linear takes this call (a caller falls back to F.linear otherwise)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] <= MAX_K
            and weight.is_contiguous() and x.stride(-1) == 1 and x.dtype == weight.dtype)


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x [M <= MAX_ROWS, K] (unit stride in K) and a contiguous weight [N, K <= MAX_K]."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    _check_tensor("weight", weight, 2, _FLOAT_DTYPES, x.device)
    _check_same("weight", weight, "x", x, shape=False)
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"x has {m} rows; decode_linear takes 1 to MAX_ROWS={MAX_ROWS}")
    if weight.shape[1] != k or not 0 < k <= MAX_K or n == 0:
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} (K at most {MAX_K})")
    if not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError("weight must be contiguous and x must have unit stride in K")
    if x.device.type != "cuda" and not is_interpreted(_decode_gemv_kernel):
        raise ValueError(f"x on {x.device} needs a CUDA device or the Triton interpreter (TRITON_INTERPRET=1)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = decode_gemv_config(n, k)
    _decode_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, out, x.stride(0), out.stride(0), m, n, k, **cfg, **pdl(_decode_gemv_kernel, x.device))
    return out
