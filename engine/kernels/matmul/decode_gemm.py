"""Matmuls of a decode step with up to 32 rows on tensor cores, the weight loaded before the wait.

    decode_linear(x [MIN_ROWS <= M <= MAX_ROWS, K], weight [N, K]) -> [M, N]    (= F.linear(x, weight))
    decode_norm_linear(x, norm_weight, eps, weight, residual=None) -> (out, new_residual)
                                                          (= F.linear(fused_ops.rms_norm(...), weight))
    decode_silu_linear(gate_up, weight, residual=None) -> out
                                                  (= [residual +] F.linear(fused_ops.silu_mul(gate_up), weight))
    decode_norm_linear_silu(x, norm_weight, eps, gate_up_weight, residual=None) -> (act, new_residual)
                                                  (= fused_ops.silu_mul(decode_norm_linear(...)[0]))

engine/kernels/matmul/decode_gemv.py for the rows of 32 streams, a verification of 1 + K tokens (from one stream, where
the route table gives it decode_gemm) or a tree of 8-32 tokens, where its loop over rows (a pass
over the registers each) would cost more than cuBLAS. The
same idea: each program owns BLOCK_N whole weight rows and loads all of them into registers before gdc_wait, so
under programmatic dependent launch the HBM read overlaps the kernel before; after the wait it reads x (L2),
recomputes the op before (the norm or SiLU * up), multiplies and stores. The same prologues, epilogues ("store",
"add", "argmax", "silu_mul") and rounding as decode_gemv (common.round_to, the interpreter included).

Why the whole K before the wait, not K chunks of which only the first are prefetched: SmolLM2's K is 576 or 1536,
so a tile of 16-32 rows is 18-48 KB, 36-96 registers a thread, and with all of it loaded nothing after the wait
goes to HBM; a chunk left for after the wait costs an HBM round trip there, the latency this kernel removes.
Hence MAX_K = 2048 (16 rows of it: 64 registers a thread at 8 warps); larger K takes cuBLAS.

Layout. tl.arange widths are powers of two, so K is two pieces, K0 the largest power of two <= K and K1 the rest
rounded up to one (or none): 576 = 512 + 64 and 1536 = 1024 + 512 pad nothing. Each piece is C chunks of BLOCK_K
columns on the batch axis of a 3-D tl.dot, weight [C, BLOCK_N, BLOCK_K] x rows [C, BLOCK_K, BLOCK_M], summed over
the chunks: the weight rows are the MMA's M side and the tokens its N side (swap-AB, no padding of a row count to
64), and K is split over independent MMA chains and warps, where one 2-D dot over K = 1536 would be a chain of 96
dependent MMAs. Tokens go in groups of BLOCK_M (8: M padded to a multiple of 8 by masked rows), unrolled when a
program takes several: a group's x tile [K, BLOCK_M] is what sits in registers beside the weight. The norm's sum
of squares needs the whole row: a first pass over the group's x (both pieces) gives it, then a second (L1)
computes A.

Accumulation is fp32, rounded once to x.dtype, in another order than cuBLAS: results agree to rounding, not bit
for bit. Grid and constexprs depend only on shapes, so every call can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.matmul import decode_gemv, gemv_checks
from engine.kernels.matmul.silu_pairs import block_rows, out_columns, pairs_fit, silu_store
from engine.kernels.sampling.argmax import store_block_max
from engine.kernels.common import is_interpreted, pdl, reduce_sum, round_to

MIN_ROWS = 1
MAX_ROWS = 32
MAX_K = 2048
_LIMITS = dict(rows=(MIN_ROWS, MAX_ROWS), max_k=MAX_K)
_TILE = 49152  # weight elements a program may hold (64 x 576); 16 rows of any K <= MAX_K fit, so 4 warps always
_PROGRAMS = 90  # the fewest programs a wider weight tile may leave (about two thirds of a 132-SM GPU)
# the same in a decode step (one token a sequence). There o_proj and down at 25-32 rows take 32 weight rows a program
# (72 programs, not 144 of 16): slower themselves, but the kernels after them (gate_up, attention) load their weights
# beside fewer programs, and the step is shorter. A verification step of the same rows (8 streams x 4 tokens) is
# longer with it, so it keeps _PROGRAMS (docs/decode_step.md, "The decode launch rule").
DECODE_PROGRAMS = 72


@triton.jit
def _cols(START: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns START .. START + WIDTH as [WIDTH // BLOCK_K chunks, BLOCK_K]."""
    return START + tl.arange(0, WIDTH // BLOCK_K)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]


@triton.jit
def _load_w(w_ptr, offs_n, n_ok, K, START: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr):
    """The piece's weight tile [chunk, n, k]."""
    kk = _cols(START, WIDTH, BLOCK_K)
    return tl.load(w_ptr + offs_n.to(tl.int64)[None, :, None] * K + kk[:, None, :],
                   mask=n_ok[None, :, None] & (kk < K)[:, None, :], other=0.0)


@triton.jit
def _load_x(ptr, stride, offs_m, m_ok, K, START: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
            HALF: tl.constexpr):
    """Rows offs_m of x's piece as [chunk, k, m] (HALF = 1: the up half of a gate_up row), and its pointers' mask."""
    kk = _cols(START, WIDTH, BLOCK_K)
    ok = (kk < K)[:, :, None] & m_ok[None, None, :]
    return tl.load(ptr + offs_m[None, None, :] * stride + HALF * K + kk[:, :, None], mask=ok, other=0.0), ok


@triton.jit
def _load_h(x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, START: tl.constexpr, WIDTH: tl.constexpr,
            BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """x [+ residual] of the piece, the sum rounded to the dtype as torch's add (the new residual, the norm's input)."""
    h, ok = _load_x(x_ptr, stride_x, offs_m, m_ok, K, START, WIDTH, BLOCK_K, 0)
    if HAS_RESIDUAL:
        r, _ = _load_x(res_ptr, stride_res, offs_m, m_ok, K, START, WIDTH, BLOCK_K, 0)
        h = round_to(h.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
    return h, ok


@triton.jit
def _sum_sq(x_ptr, res_ptr, new_res_ptr, stride_x, stride_res, stride_new_res, offs_m, m_ok, K, store,
            START: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The piece's share of each row's sum of squares [BLOCK_M]; `store`: this program stores the new residual."""
    h, ok = _load_h(x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, START, WIDTH, BLOCK_K, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        if store:
            kk = _cols(START, WIDTH, BLOCK_K)
            tl.store(new_res_ptr + offs_m[None, None, :] * stride_new_res + kk[:, :, None], h, mask=ok)
    hf = h.to(tl.float32)
    return reduce_sum(reduce_sum(hf * hf, 1), 0)


@triton.jit
def _piece(w, nw, inv, x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, START: tl.constexpr,
           WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
           UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The piece's share of acc[n, m] = w[n, :] . A[m, :], A = the prologue of x rounded as the separate kernels
    round it: rms_norm ("norm", inv = each row's 1 / rms), silu_mul ("silu") or x itself. Masked lanes are 0.
    A 2-D dot of one chunk (Hopper's warpgroup MMA) was slower in the step."""
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == "norm":
        h, _ = _load_h(x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, START, WIDTH, BLOCK_K, HAS_RESIDUAL)
        normed = round_to(h.to(tl.float32) * inv[None, None, :], dtype)
        a = round_to(nw.to(tl.float32)[:, :, None] * normed.to(tl.float32), dtype)
    elif PROLOGUE == "silu":
        g, _ = _load_x(x_ptr, stride_x, offs_m, m_ok, K, START, WIDTH, BLOCK_K, 0)
        u, _ = _load_x(x_ptr, stride_x, offs_m, m_ok, K, START, WIDTH, BLOCK_K, 1)
        g = g.to(tl.float32)
        a = round_to(g / (1.0 + tl.exp(-g)) * u.to(tl.float32), dtype)
    else:
        a, _ = _load_x(x_ptr, stride_x, offs_m, m_ok, K, START, WIDTH, BLOCK_K, 0)
    if UPCAST:  # the interpreter's dot multiplies bf16 bit patterns; bf16 products are exact in fp32
        w, a = w.to(tl.float32), a.to(tl.float32)
    return reduce_sum(tl.dot(w, a, input_precision=PRECISION), 0)


@triton.jit
def _epilogue(acc, out_ptr, add_ptr, idx_ptr, stride_out, stride_add, offs_n, n_ok, offs_m, m_ok, pid, N,
              dtype: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] rounded once to y, then decode_gemv's epilogues, transposed."""
    y = round_to(acc, dtype)
    if EPILOGUE == "silu_mul":
        silu_store(out_ptr, tl.trans(y), offs_m, m_ok, stride_out, N, pid, BLOCK_M, BLOCK_N)
    elif EPILOGUE == "argmax":
        store_block_max(y, offs_n, n_ok, N, offs_m, m_ok, stride_out, pid, out_ptr, idx_ptr)
    else:
        ok = n_ok[:, None] & m_ok[None, :]
        if EPILOGUE == "add":
            r = tl.load(add_ptr + offs_m[None, :] * stride_add + offs_n[:, None], mask=ok, other=0.0)
            y = round_to(y.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(out_ptr + offs_m[None, :] * stride_out + offs_n[:, None], y, mask=ok)


@triton.jit
def _decode_gemm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, new_res_ptr, add_ptr, idx_ptr, stride_x, stride_res,
                        stride_out, stride_new_res, stride_add, M, N, K, eps, PROLOGUE: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                        GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, K0: tl.constexpr, BK0: tl.constexpr,
                        K1: tl.constexpr, BK1: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """decode_gemv's kernel on tensor cores: y = A @ w.T over pieces K0 (+ K1) of K, for the GROUPS groups of
    BLOCK_M rows from program_id(1) * GROUPS * BLOCK_M."""
    pid = tl.program_id(0)
    first = tl.program_id(1) * (GROUPS * BLOCK_M)
    dtype = x_ptr.dtype.element_ty
    offs_n, n_ok = block_rows(pid, N, BLOCK_N, EPILOGUE)
    # the weights do not depend on the kernel before: read them before waiting for it
    w0 = _load_w(w_ptr, offs_n, n_ok, K, 0, K0, BK0)
    nw0, nw1, inv = 0.0, 0.0, 0.0               # the norm's; other prologues pass them unread
    if K1 > 0:
        w1 = _load_w(w_ptr, offs_n, n_ok, K, K0, K1, BK1)
    if PROLOGUE == "norm":
        kk0 = _cols(0, K0, BK0)
        nw0 = tl.load(nw_ptr + kk0, mask=kk0 < K, other=0.0)
        if K1 > 0:
            kk1 = _cols(K0, K1, BK1)
            nw1 = tl.load(nw_ptr + kk1, mask=kk1 < K, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for g in tl.static_range(GROUPS):
        offs_m = first + g * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        if PROLOGUE == "norm":   # the programs of the first weight rows store their rows' new residual
            ss = _sum_sq(x_ptr, res_ptr, new_res_ptr, stride_x, stride_res, stride_new_res, offs_m, m_ok, K, pid == 0,
                         0, K0, BK0, HAS_RESIDUAL)
            if K1 > 0:
                ss += _sum_sq(x_ptr, res_ptr, new_res_ptr, stride_x, stride_res, stride_new_res, offs_m, m_ok, K,
                              pid == 0, K0, K1, BK1, HAS_RESIDUAL)
            inv = tl.rsqrt(tl.where(m_ok, ss / K + eps, 1.0))      # padded rows stay finite (eps may be 0)
        acc = _piece(w0, nw0, inv, x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, 0, K0, BK0, PROLOGUE,
                     HAS_RESIDUAL, UPCAST, PRECISION)
        if K1 > 0:
            acc += _piece(w1, nw1, inv, x_ptr, res_ptr, stride_x, stride_res, offs_m, m_ok, K, K0, K1, BK1, PROLOGUE,
                          HAS_RESIDUAL, UPCAST, PRECISION)
        _epilogue(acc, out_ptr, add_ptr, idx_ptr, stride_out, stride_add, offs_n, n_ok, offs_m, m_ok, pid, N, dtype,
                  EPILOGUE, BLOCK_M, BLOCK_N)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_decode_gemm_kernel) and decode_gemv.interpreted()


def pieces(k: int) -> tuple[int, int]:
    """K as (K0, K1): K0 the largest power of two <= K, K1 the rest rounded up to one or 0; tl.dot's K >= 16."""
    k0 = max(16, 1 << (k.bit_length() - 1))
    return k0, (max(16, triton.next_power_of_2(k - k0)) if k > k0 else 0)


def decode_gemm_config(m: int, n: int, k: int, decode: bool = False) -> dict:
    """Launch parameters by shape and step kind (a bench may replace this function; decode: every row is a
    sequence's one token). Groups of BLOCK_M = 8 tokens, one a program: the programs of a step's row groups each
    read the weight tile again (from L2 after the first), and that parallelism beats reusing the tile in registers
    (GROUPS 2 or BLOCK_M 16-32 were slower at 16-32 rows). BLOCK_N: the widest of
    64 / 32 weight rows that still gives >= _PROGRAMS (DECODE_PROGRAMS) programs and fits _TILE weights, else 16.
    BLOCK_K: columns a chunk. No loop to pipeline: num_stages 1."""
    width, groups = sum(pieces(k)), triton.cdiv(m, 8)
    least = DECODE_PROGRAMS if decode else _PROGRAMS
    block_n = next((bn for bn in (64, 32) if bn * width <= _TILE and triton.cdiv(n, bn) * groups >= least), 16)
    return dict(BLOCK_M=8, GROUPS=1, BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=1)


def supports(x: torch.Tensor, weight: torch.Tensor, k: int | None = None, norm_weight=None, residual=None,
             add=None) -> bool:
    """Whether these kernels take a call (the arguments as decode_gemv.supports'); a caller falls back to the
    separate kernels and cuBLAS otherwise."""
    return gemv_checks.problem(x, weight, x.shape[-1] if k is None else k, norm_weight, residual, add,
                               **_LIMITS) is None


def launch(x, weight, k, prologue, nw=None, eps=0.0, residual=None, add=None, epilogue="store", decode=False):
    """The kernel on checked inputs -> (out, new_residual, idx), as decode_gemv.launch; decode: the step's rows
    are one token a sequence (decode_gemm_config)."""
    m, n = x.shape[0], weight.shape[0]
    cfg = dict(decode_gemm_config(m, n, k, decode))
    block_m, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_K")
    if interpreted():       # programs run one after another there: all rows in one group (the same bits, any config)
        block_m = max(block_m, min(MAX_ROWS, triton.next_power_of_2(m)))
    row_groups = triton.cdiv(m, block_m)
    groups = min(cfg.pop("GROUPS", row_groups), row_groups)
    k0, k1 = pieces(k)
    n, grid = out_columns(n, cfg["BLOCK_N"], epilogue)
    out, idx, new_res, res, add = decode_gemv.buffers(x, n, k, grid, epilogue, residual, add)
    upcast = x.dtype == torch.bfloat16 and interpreted()
    _decode_gemm_kernel[(grid, triton.cdiv(m, groups * block_m))](
        x, res, x if nw is None else nw, weight, out, new_res, add, idx, x.stride(0), res.stride(0), out.stride(0),
        new_res.stride(0), add.stride(0), m, n, k, float(eps), PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        EPILOGUE=epilogue, BLOCK_M=block_m, GROUPS=groups, K0=k0, BK0=min(block_k, k0), K1=k1,
        BK1=min(block_k, max(k1, 16)), UPCAST=upcast,
        PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        **cfg, **pdl(_decode_gemm_kernel, x.device, m))
    return out, new_res, idx


def decode_linear(x: torch.Tensor, weight: torch.Tensor, decode: bool = False) -> torch.Tensor:
    """F.linear(x, weight) for x [MIN_ROWS <= M <= MAX_ROWS, K] (unit stride in K), weight [N, K <= MAX_K].
    decode (here and below): the rows are a decode step's, one token a sequence; it picks the launch only."""
    gemv_checks.check(x, weight, **_LIMITS)
    return launch(x, weight, x.shape[1], "none", decode=decode)[0]


def decode_norm_linear(x, norm_weight, eps: float, weight, residual=None, decode: bool = False):
    """F.linear(fused_ops.rms_norm(x, norm_weight, eps, residual), weight) in one kernel. Returns (out,
    new_residual): with a residual, h = x + residual rounded to the dtype (a new tensor), else x itself."""
    gemv_checks.check(x, weight, norm_weight=norm_weight, residual=residual, **_LIMITS)
    return launch(x, weight, x.shape[1], "norm", nw=norm_weight, eps=eps, residual=residual, decode=decode)[:2]


def decode_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, residual=None, decode: bool = False):
    """F.linear(fused_ops.silu_mul(gate_up), weight) in one kernel: gate_up [M, 2 * I] (gate, then up). With a
    residual [M, N]: residual + that, rounded as the two torch ops round it."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2 * I], got {tuple(gate_up.shape)}")
    gemv_checks.check(gate_up, weight, gate_up.shape[1] // 2, add=residual, **_LIMITS)
    return launch(gate_up, weight, gate_up.shape[1] // 2, "silu", add=residual,
                  epilogue="store" if residual is None else "add", decode=decode)[0]


def silu_mul_fits(weight: torch.Tensor) -> bool:
    """Whether decode_norm_linear_silu takes this [gate; up] weight: an even N (a program always holds 16+ rows)."""
    return pairs_fit(weight)


def decode_norm_linear_silu(x, norm_weight, eps: float, weight, residual=None, decode: bool = False):
    """fused_ops.silu_mul(decode_norm_linear(...)) in one kernel, for weight = [gate; up] ([2 * I, K]): each
    program computes gate rows and their up rows and stores silu(gate) * up. Returns (act [M, I], new_residual)
    as decode_norm_linear's."""
    gemv_checks.check(x, weight, norm_weight=norm_weight, residual=residual, **_LIMITS)
    if not silu_mul_fits(weight):
        raise ValueError(f"weight {tuple(weight.shape)} must be [gate; up] with an even N")
    return launch(x, weight, x.shape[1], "norm", nw=norm_weight, eps=eps, residual=residual, epilogue="silu_mul",
                  decode=decode)[:2]
