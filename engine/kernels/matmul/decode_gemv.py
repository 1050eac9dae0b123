"""Matmuls of a decode step with a few rows: out = x @ weight.T, the weight loaded before the wait.

    decode_linear(x [M <= MAX_ROWS, K], weight [N, K]) -> [M, N]        (= F.linear(x, weight))
    decode_norm_linear(x, norm_weight, eps, weight, residual=None) -> (out, new_residual)
                                                          (= F.linear(fused_ops.rms_norm(...), weight))
    decode_silu_linear(gate_up, weight, residual=None) -> out
                                                  (= [residual +] F.linear(fused_ops.silu_mul(gate_up), weight))
    decode_norm_linear_silu(x, norm_weight, eps, gate_up_weight, residual=None) -> (act, new_residual)
                                                  (= fused_ops.silu_mul(decode_norm_linear(...)[0]))

At one stream a decode step's matmuls read a small model's weights in kernels that take several times their
bandwidth floor: they are latency, not bandwidth. Each program here owns BLOCK_N whole weight rows and loads
them into registers first. Launched with programmatic dependent launch (engine/kernels/common.pdl), that load
runs while the kernel before it (the norm, the attention, SiLU * up) is still finishing, since weights never
change during a step. Only then does it wait (gdc_wait) and read x, so what remains after the dependency is an
L2 read of x, a row reduction and a store. Without PDL it is a plain GEMV.

A program holds whole rows of x too, so the op before the matmul comes free: the residual add + RMSNorm before
qkv and gate_up, SiLU * up before down. Each program recomputes it on its copy of x (576 or 1536 values), and
program 0 stores the new residual; the layers run no norm or SiLU kernel of their own.

The op after comes free too (EPILOGUE): the EAGLE head's residual add after its down projection, the argmax of
each row over the program's outputs (the LM head's first half of a greedy draft, engine/kernels/matmul/draft_gemv.py),
or SiLU * up ("silu_mul"): a program of gate_up takes gate rows and the up rows of the same columns, so it stores
the activation itself. The down projection after it then reads I values a row, not 2 I, and computes no SiLU:
with the SiLU prologue every one of its programs recomputed the whole row's (8192 exp a program at Llama 1B's
down, 2048 programs).

Rows. In a loop over rows each row is a pass waiting on the one before (x load, reductions, stores), so each row
adds its own latency. Steps of 2-4 rows (AT_ONCE_ROWS; a one-stream verification at K = 3) reduce one
[rows, BLOCK_N, BLOCK_K] product of every row's x, loaded at once, equal to the loop's up to K's summation order;
past 4 rows or K > 2048 its registers spill, and single rows gain nothing: those keep the loop.

Accumulation is fp32 (exact products for fp32 inputs), rounded once to x.dtype to nearest even, as torch rounds
(common.round_to, the interpreter included); the summation order differs from cuBLAS, so results agree to
rounding, not bit for bit. The grid and constexprs depend only on shapes, so every call can be captured in a
CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.matmul import gemv_checks
from engine.kernels.common import is_interpreted, pdl, reduce_max, reduce_min, reduce_sum, round_to
from engine.kernels.matmul.gemv_checks import check, problem
from engine.kernels.matmul.silu_pairs import block_rows, out_columns, pairs_fit, silu_store

MAX_ROWS, MAX_K = gemv_checks.MAX_ROWS, gemv_checks.MAX_K   # the rows and K these kernels take
MAX_K_PLAIN = gemv_checks.MAX_K_PLAIN                       # decode_linear's K (no prologue)
_ELEMS = 8192           # weight elements per program (BLOCK_N x BLOCK_K): 64 per thread at 4 warps
AT_ONCE_ROWS = (2, 4)   # steps of 2-4 rows with BLOCK_K <= AT_ONCE_MAX_K take every row at once (_rows_at_once);
AT_ONCE_MAX_K = 2048    # past these the product's registers spill
FOUR_WARPS_K = 4096     # rows up to this K run 4 warps, longer ones 8 (_warps)


@triton.jit
def _decode_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, new_res_ptr, add_ptr, idx_ptr, stride_x, stride_res,
                        stride_out, stride_new_res, stride_add, M, N, K, eps, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr):
    """y[m] = A[m] @ w.T with A = x ("none"), rms_norm(x [+ res]) ("norm"; program 0 stores the new residual)
    or silu(x[:, :K]) * x[:, K:] ("silu"). A is rounded to the dtype as the separate kernels round it, y as
    F.linear rounds it. The epilogue stores out[m] = y[m] ("store"), y[m] + add[m] rounded as torch's add
    ("add"), this program's largest y[m, n] and its first n at out[m, pid] / idx[m, pid] ("argmax"), or
    silu_mul of y[m] as [gate; up] of N columns each ("silu_mul", silu_store).
    ROWS = 0: a pass over the registers per row; ROWS >= M: every row at once (_rows_at_once)."""
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    offs_n, n_ok = block_rows(pid, N, BLOCK_N, EPILOGUE)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    # the weights do not depend on the kernel before: read them before waiting for it
    w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    nw = w                      # unused unless "norm"
    if PROLOGUE == "norm":
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if ROWS:
        _rows_at_once(x_ptr, res_ptr, w, nw, out_ptr, new_res_ptr, add_ptr, idx_ptr, stride_x, stride_res, stride_out,
                      stride_new_res, stride_add, M, N, K, eps, pid, offs_n, offs_k, n_ok, k_ok, PROLOGUE,
                      HAS_RESIDUAL, EPILOGUE, ROWS, BLOCK_N)
    else:
        for m in range(M):
            x = tl.load(x_ptr + m * stride_x + offs_k, mask=k_ok, other=0.0)
            if PROLOGUE == "norm":
                if HAS_RESIDUAL:
                    r = tl.load(res_ptr + m * stride_res + offs_k, mask=k_ok, other=0.0)
                    x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
                    if pid == 0:
                        tl.store(new_res_ptr + m * stride_new_res + offs_k, x, mask=k_ok)
                xf = x.to(tl.float32)
                inv = tl.rsqrt(reduce_sum(xf * xf, 0) / K + eps)
                a = (nw * (xf * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            elif PROLOGUE == "silu":
                g = x.to(tl.float32)
                u = tl.load(x_ptr + m * stride_x + K + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
            else:
                a = x.to(tl.float32)
            y = round_to(reduce_sum(w * a[None, :], 1), dtype)
            if EPILOGUE == "argmax":
                # masked rows sit at -inf after every real row of the block, so the first maximum is a real row;
                # NaN ranks above every number (one row's draft is a guess either way)
                v = tl.where(n_ok, y.to(tl.float32), float("-inf"))
                v = tl.where(v != v, float("inf"), v)
                top = reduce_max(v, 0)
                tl.store(out_ptr + m * stride_out + pid, top)
                tl.store(idx_ptr + m * stride_out + pid, reduce_min(tl.where(v == top, offs_n, N), 0))
            elif EPILOGUE == "silu_mul":
                rows = tl.full([1], m, tl.int32)
                silu_store(out_ptr, y[None, :], rows, rows < M, stride_out, N, pid, 1, BLOCK_N)
            else:
                if EPILOGUE == "add":
                    r = tl.load(add_ptr + m * stride_add + offs_n, mask=n_ok, other=0.0)
                    y = round_to(y.to(tl.float32) + r.to(tl.float32), dtype)
                tl.store(out_ptr + m * stride_out + offs_n, y, mask=n_ok)


@triton.jit
def _rows_at_once(x_ptr, res_ptr, w, nw, out_ptr, new_res_ptr, add_ptr, idx_ptr, stride_x, stride_res, stride_out,
                  stride_new_res, stride_add, M, N, K, eps, pid, offs_n, offs_k, n_ok, k_ok,
                  PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EPILOGUE: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The kernel's work after the wait for all M <= ROWS rows together: one load of x [ROWS, BLOCK_K], the
    prologue on all of it, one product [ROWS, BLOCK_N, BLOCK_K] reduced over K. The row loop's passes wait on
    each other (a row's x load, its reductions and stores, then the next row's); here those latencies overlap.
    Each row's value is the loop's, rounding included, up to the order in which the compiled reduction sums K
    (the same bits in the interpreter, and in bf16 on sm_90 at SmolLM2's and Llama 1B's K <= 2048)."""
    a, offs_m, m_ok = _rows_prologue(x_ptr, res_ptr, nw, new_res_ptr, stride_x, stride_res, stride_new_res, M, K,
                                     eps, pid, offs_k, k_ok, PROLOGUE, HAS_RESIDUAL, ROWS)
    dtype = x_ptr.dtype.element_ty
    y = round_to(reduce_sum(w[None, :, :] * a[:, None, :], 2), dtype)          # [ROWS, BLOCK_N]
    if EPILOGUE == "argmax":   # as the loop's: masked vocabulary rows at -inf, NaN above every number
        v = tl.where(n_ok[None, :], y.to(tl.float32), float("-inf"))
        v = tl.where(v != v, float("inf"), v)
        top = reduce_max(v, 1)
        tl.store(out_ptr + offs_m * stride_out + pid, top, mask=m_ok)
        first = reduce_min(tl.where(v == top[:, None], offs_n[None, :], N), 1)
        tl.store(idx_ptr + offs_m * stride_out + pid, first, mask=m_ok)
    elif EPILOGUE == "silu_mul":
        silu_store(out_ptr, y, offs_m, m_ok, stride_out, N, pid, ROWS, BLOCK_N)
    else:
        ym = m_ok[:, None] & n_ok[None, :]
        if EPILOGUE == "add":
            r = tl.load(add_ptr + offs_m[:, None] * stride_add + offs_n[None, :], mask=ym, other=0.0)
            y = round_to(y.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], y, mask=ym)


@triton.jit
def _rows_prologue(x_ptr, res_ptr, nw, new_res_ptr, stride_x, stride_res, stride_new_res, M, K, eps, pid, offs_k,
                   k_ok, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr):
    """(A [ROWS, BLOCK_K] in fp32, the rows, their mask): every row's x in one load and the prologue on all of
    it, rounded as the loop rounds it; program 0 stores the new residual."""
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, ROWS)
    m_ok = offs_m < M
    xm = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=xm, other=0.0)
    if PROLOGUE == "norm":
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs_m[:, None] * stride_res + offs_k[None, :], mask=xm, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            if pid == 0:
                tl.store(new_res_ptr + offs_m[:, None] * stride_new_res + offs_k[None, :], x, mask=xm)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(reduce_sum(xf * xf, 1) / K + eps)
        a = (nw[None, :] * (xf * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    elif PROLOGUE == "silu":
        g = x.to(tl.float32)
        u = tl.load(x_ptr + offs_m[:, None] * stride_x + K + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(dtype).to(tl.float32)
    else:
        a = x.to(tl.float32)
    return a, offs_m, m_ok


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_decode_gemv_kernel)


def decode_gemv_config(n: int, k: int, m: int = 1, at_once: bool | None = None) -> dict:
    """BLOCK_K: the whole row (a power of two); BLOCK_N: as many rows as fit _ELEMS, at least one; ROWS: m
    rounded up to a power of two where all rows go at once (at_once None: AT_ONCE_ROWS and AT_ONCE_MAX_K say
    where that is faster than the loop), else 0 (the loop); num_warps by BLOCK_K (_warps)."""
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(_ELEMS // block_k, triton.next_power_of_2(n)))
    if at_once is None:
        at_once = AT_ONCE_ROWS[0] <= m <= AT_ONCE_ROWS[1] and not one_row_at_a_time(k)
    rows = triton.next_power_of_2(m) if at_once else 0
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, ROWS=rows, num_warps=_warps(block_k))


def one_row_at_a_time(k: int) -> bool:
    """Whether steps of several rows of this K take the loop, a pass over the registers per row (past
    AT_ONCE_MAX_K), not every row at once."""
    return triton.next_power_of_2(k) > AT_ONCE_MAX_K


def _warps(block_k: int) -> int:
    """4 to FOUR_WARPS_K, 8 past it: 64 weight values a thread at _ELEMS a program, and long rows alike. At Llama
    8B's shapes: on 8 warps the norm prologue's two row reductions cost gate_up bandwidth; o_proj (K = 4096) on 4
    keeps twice the programs resident, so twice the weight is loaded while attention runs; the down projection's
    14336-long rows are faster on 8 than on 16 (docs/decode_step.md)."""
    return 4 if block_k <= FOUR_WARPS_K else 8


def supports(x: torch.Tensor, weight: torch.Tensor, k: int | None = None, norm_weight=None, residual=None,
             add=None, max_k: int = MAX_K) -> bool:
    """Whether these kernels take a call on x with this weight (k: the matmul's K when it is not x's width, as
    for silu's gate and up halves; norm_weight / residual: decode_norm_linear's; add: decode_silu_linear's
    residual; max_k: up to MAX_K_PLAIN for decode_linear); a caller falls back to the separate kernels and cuBLAS
    otherwise."""
    return problem(x, weight, x.shape[-1] if k is None else k, norm_weight, residual, add, max_k=max_k) is None


def buffers(x, n: int, k: int, grid: int, epilogue: str, residual=None, add=None):
    """(out, idx, new_residual, residual, add) of a launch of `grid` programs over N = n: the outputs ("argmax":
    each program's maximum and its row), with x standing in for the pointers the launch does not use."""
    m = x.shape[0]
    if epilogue == "argmax":
        out = torch.empty((m, grid), dtype=torch.float32, device=x.device)
        idx = torch.empty((m, grid), dtype=torch.int32, device=x.device)
    else:
        out, idx = torch.empty((m, n), dtype=x.dtype, device=x.device), x
    new_res = x if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    return out, idx, new_res, x if residual is None else residual, x if add is None else add


def launch(x, weight, k, prologue, nw=None, eps=0.0, residual=None, add=None, epilogue="store", at_once=None,
           config=None):
    """The kernel on checked inputs -> (out, new_residual, idx): out [M, N] and idx = x, with "silu_mul" out
    [M, N / 2], or with "argmax" each program's maximum [M, programs] (fp32) and its row idx (int32). at_once:
    decode_gemv_config's; config: a launch config in its place (benches)."""
    m, n = x.shape[0], weight.shape[0]
    cfg = config or decode_gemv_config(n, k, m, at_once)
    n, grid = out_columns(n, cfg["BLOCK_N"], epilogue)
    out, idx, new_res, res, add = buffers(x, n, k, grid, epilogue, residual, add)
    _decode_gemv_kernel[(grid,)](
        x, res, x if nw is None else nw, weight, out, new_res, add, idx, x.stride(0), res.stride(0), out.stride(0),
        new_res.stride(0), add.stride(0), m, n, k, float(eps), PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        EPILOGUE=epilogue, **cfg, **pdl(_decode_gemv_kernel, x.device, m))
    return out, new_res, idx


def decode_linear(x: torch.Tensor, weight: torch.Tensor, add=None) -> torch.Tensor:
    """F.linear(x, weight) for x [M <= MAX_ROWS, K] (unit stride in K) and a contiguous weight [N, K <=
    MAX_K_PLAIN]; with add [M, N]: add + that, rounded as the two torch ops round it."""
    check(x, weight, add=add, max_k=MAX_K_PLAIN)
    return launch(x, weight, x.shape[1], "none", add=add, epilogue="store" if add is None else "add")[0]


def decode_norm_linear(x, norm_weight, eps: float, weight, residual=None):
    """F.linear(fused_ops.rms_norm(x, norm_weight, eps, residual), weight) in one kernel. Returns (out,
    new_residual): with a residual, h = x + residual rounded to the dtype (a new tensor), else x itself."""
    check(x, weight, norm_weight=norm_weight, residual=residual)
    return launch(x, weight, x.shape[1], "norm", nw=norm_weight, eps=eps, residual=residual)[:2]


def silu_mul_fits(weight: torch.Tensor) -> bool:
    """Whether decode_norm_linear_silu takes this [gate; up] weight: an even N, and a program holding at least
    one gate row and its up row (BLOCK_N >= 2: K <= 4096)."""
    return pairs_fit(weight) and decode_gemv_config(*weight.shape)["BLOCK_N"] >= 2


def decode_norm_linear_silu(x, norm_weight, eps: float, weight, residual=None):
    """fused_ops.silu_mul(decode_norm_linear(...)) in one kernel, for weight = [gate; up] ([2 * I, K]): each
    program computes gate rows and their up rows and stores silu(gate) * up. Returns (act [M, I], new_residual)
    as decode_norm_linear's."""
    check(x, weight, norm_weight=norm_weight, residual=residual)
    if not silu_mul_fits(weight):
        raise ValueError(f"weight {tuple(weight.shape)} must be [gate; up] with an even N and K <= 4096")
    return launch(x, weight, x.shape[1], "norm", nw=norm_weight, eps=eps, residual=residual, epilogue="silu_mul")[:2]


def decode_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, residual=None) -> torch.Tensor:
    """F.linear(fused_ops.silu_mul(gate_up), weight) in one kernel: gate_up [M, 2 * I] (gate, then up). With a
    residual [M, N]: residual + that, rounded as the two torch ops round it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2 * I], got {tuple(gate_up.shape)}")
    check(gate_up, weight, gate_up.shape[1] // 2, add=residual)
    return launch(gate_up, weight, gate_up.shape[1] // 2, "silu", add=residual,
                  epilogue="store" if residual is None else "add")[0]
