"""torch.argmax over the rows of a step's logits, in two kernels of the dependent-launch chain.

    argmax_rows(x [M, V] float, unit stride in V) -> int64 [M]      (= x.argmax(-1), NaN counted as largest)
    argmax_rows(x, ids [V] int64) -> int64 [M]                       (= ids[x.argmax(-1)]: a draft vocabulary)

A greedy step's tokens were the LM head's cuBLAS GEMM, a cast of its [M, V] logits to float32 and torch's argmax
(one block-wide reduce per row). Here the cast is gone (the argmax of the dtype's logits is that of their float32
copy: the cast is exact) and the reduction is spread: kernel 1 gives each program BLOCK_V logits of one row and
keeps their maximum and its first column; kernel 2 reduces a row's partials to its first maximal column.
draft_gemv.py's GEMV argmax epilogue writes the same partials and ends with the same kernel 2.

A greedy guided step takes the same two kernels with its grammar bitmask (masked_argmax): kernel 1 reads the
logits in the head's dtype, drops the tokens the mask disallows and counts the allowed ones; kernel 2 gives a row
with none NO_TOKEN and a row the host forces its forced token. That is engine.sampling.sampler.sample's greedy
answer on the masked float32 logits, then engine.runner.step.forced, in two kernels where they take six.

Tie rule, as torch.argmax: the first maximal column wins; a row holding a NaN gives its first NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_max, reduce_min, reduce_sum
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_tensor

BLOCK_V = 1024    # logits of a row per kernel-1 program (4 rows of SmolLM2's 49152: 192 programs)
BLOCK_P = 8192    # partials of a row kernel 2 reads at a time: every wave of loads is one wait (the LM head
                  # GEMV's argmax at Llama 8B leaves 64 K partials a row: 8 waves, not 64 at 1024)
_NO_COLUMN = tl.constexpr(2147483647)
NO_TOKEN = tl.constexpr(-1)       # engine.sampling.sampler.NO_TOKEN: a row whose mask allows nothing


@triton.jit
def _store_partial(x, cols, val_ptr, idx_ptr):
    """*val_ptr, *idx_ptr = the largest of x (float32) and its first column in cols (increasing), or a NaN and the
    first NaN's column where there is one. Columns past a row's end hold -inf: a row of -inf picks its first real
    column, which comes before them."""
    nan = x != x
    top = reduce_max(tl.where(nan, float("-inf"), x), 0)
    has_nan = reduce_max(nan.to(tl.int32), 0) > 0
    tl.store(val_ptr, tl.where(has_nan, float("nan"), top))
    tl.store(idx_ptr, reduce_min(tl.where(tl.where(has_nan, nan, x == top), cols, _NO_COLUMN), 0))


@triton.jit
def _block_max_kernel(x_ptr, val_ptr, idx_ptr, stride_x, stride_p, V, BLOCK_V: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """val[m, p], idx[m, p] = the largest of x[m, p * BLOCK_V:(p + 1) * BLOCK_V] and its first column (a NaN and
    the first NaN's column where there is one)."""
    pdl_start(USE_PDL)
    m, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = p * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + m * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    _store_partial(x, cols, val_ptr + m * stride_p + p, idx_ptr + m * stride_p + p)


@triton.jit
def _masked_block_max_kernel(x_ptr, mask_ptr, val_ptr, idx_ptr, cnt_ptr, stride_x, stride_mask, stride_p, V,
                             BLOCK_V: tl.constexpr):
    """As _block_max_kernel over the logits the bitmask allows (bit j of word w allows column 32w + j; the others
    count as -inf), and cnt[m, p] = how many of the block's columns it allows."""
    m, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = p * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < V
    word = tl.load(mask_ptr + m * stride_mask + cols // 32, mask=inside, other=0)
    allowed = inside & (((word >> (cols % 32)) & 1) != 0)
    x = tl.load(x_ptr + m * stride_x + cols, mask=allowed, other=float("-inf")).to(tl.float32)
    _store_partial(x, cols, val_ptr + m * stride_p + p, idx_ptr + m * stride_p + p)
    tl.store(cnt_ptr + m * stride_p + p, reduce_sum(allowed.to(tl.int32), 0))


@triton.jit
def _first_max_kernel(val_ptr, idx_ptr, ids_ptr, tok_ptr, cnt_ptr, forced_ptr, stride, P, BLOCK_P: tl.constexpr,
                      HAS_IDS: tl.constexpr, MASKED: tl.constexpr, FORCED: tl.constexpr, USE_PDL: tl.constexpr):
    """tok[m] = the column of the first of row m's largest partials val[m, :P] (their columns idx[m, :P], in
    increasing order), or ids[that column] (HAS_IDS); a NaN partial is larger than any number, the first NaN
    the largest. MASKED: NO_TOKEN where the partials' counts cnt[m, :P] allow nothing; FORCED: then forced[m] where
    it is a token (>= 0)."""
    pdl_start(USE_PDL)
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_P], dtype=tl.int32)
    allowed = tl.zeros([BLOCK_P], dtype=tl.int32)
    for start in range(0, P, BLOCK_P):
        ok = start + offs < P
        v = tl.load(val_ptr + m * stride + start + offs, mask=ok, other=float("-inf"))
        i = tl.load(idx_ptr + m * stride + start + offs, mask=ok, other=0)
        if MASKED:
            allowed += tl.load(cnt_ptr + m * stride + start + offs, mask=ok, other=0)
        # a tie keeps the earlier partial (the lower column); a NaN replaces anything but a NaN
        take = (v > best) | ((v != v) & (best == best))
        best, best_idx = tl.where(take, v, best), tl.where(take, i, best_idx)
    # a lane never taken holds (-inf, 0): it wins only when every logit is -inf, where column 0 is torch's answer
    nan = best != best
    has_nan = reduce_max(nan.to(tl.int32), 0) > 0
    top = reduce_max(tl.where(nan, float("-inf"), best), 0)
    first = reduce_min(tl.where(tl.where(has_nan, nan, best == top), best_idx, _NO_COLUMN), 0).to(tl.int64)
    if HAS_IDS:
        first = tl.load(ids_ptr + first)
    if MASKED:
        first = tl.where(reduce_sum(allowed, 0) > 0, first, NO_TOKEN)
    if FORCED:
        forced = tl.load(forced_ptr + m)
        first = tl.where(forced >= 0, forced, first)
    tl.store(tok_ptr + m, first)


@triton.jit
def store_block_max(y, rows, rows_ok, n_rows, cols, cols_ok, stride, pid, val_ptr, idx_ptr):
    """A tensor-core argmax epilogue's partials of y [rows, cols] (logits rounded to the dtype: vocabulary rows by
    the step's rows): val[c, pid] = the largest of column c over the real rows, idx[c, pid] its first row, for
    first_max. Masked rows sit at -inf after every real row; NaN ranks above every number (as the decode GEMV's
    epilogue)."""
    v = tl.where(rows_ok[:, None], y.to(tl.float32), float("-inf"))
    v = tl.where(v != v, float("inf"), v)
    top = reduce_max(v, 0)
    tl.store(val_ptr + cols * stride + pid, top, mask=cols_ok)
    tl.store(idx_ptr + cols * stride + pid, reduce_min(tl.where(v == top[None, :], rows[:, None], n_rows), 0),
             mask=cols_ok)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_block_max_kernel)


def supports(x: torch.Tensor) -> bool:
    """Whether argmax_rows takes x: on CUDA, or on the CPU where the kernels run in the interpreter."""
    return x.device.type == "cuda" or interpreted()


def argmax_rows(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, V] (float16, bfloat16 or float32; unit stride in V) -> int64 [M], x.argmax(-1), or ids[x.argmax(-1)]
    for ids [V] int64 (contiguous)."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    m, v = x.shape
    if v == 0:
        raise ValueError("argmax_rows: x has no columns")
    check_ids(ids, v, x.device)
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return tokens
    p, val, idx = _partials(m, v, x.device)
    _block_max_kernel[(m, p)](x, val, idx, x.stride(0), p, v, BLOCK_V=BLOCK_V, num_warps=4,
                              **pdl(_block_max_kernel, x.device, m))
    return first_max(val, idx, tokens, ids)


def _partials(m: int, v: int, device) -> tuple:
    """Kernel 1's outputs for m rows of v logits: (its programs a row, val [m, p] float32, idx [m, p] int32)."""
    p = triton.cdiv(v, BLOCK_V)
    return (p, torch.empty((m, p), dtype=torch.float32, device=device),
            torch.empty((m, p), dtype=torch.int32, device=device))


def check_ids(ids: torch.Tensor | None, columns: int, device: torch.device) -> None:
    """A column -> token id map must be int64 [columns], contiguous, on the logits' device."""
    if ids is None:
        return
    _check_tensor("ids", ids, 1, (torch.int64,), device)
    if ids.shape[0] != columns or not ids.is_contiguous():
        raise ValueError(f"ids must be a contiguous int64 map of all {columns} columns, got {tuple(ids.shape)}")


def masked_argmax(x: torch.Tensor, bitmask: torch.Tensor, forced: torch.Tensor | None = None) -> torch.Tensor:
    """A greedy guided step's tokens: x [M, V] logits (float16, bfloat16 or float32; unit stride in V), bitmask
    int32 [M, >= ceil(V / 32)] (xgrammar's layout), forced int64 [M] (a token, or -1; None: none) -> int64 [M]:
    the first maximal allowed column, NO_TOKEN for a row that allows none, the forced token where there is one."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    _check_tensor("bitmask", bitmask, 2, (torch.int32,), x.device)
    m, v = x.shape
    if forced is not None:
        _check_tensor("forced", forced, 1, (torch.int64,), x.device)
        if forced.shape[0] != m or not forced.is_contiguous():
            raise ValueError(f"forced must be a contiguous [{m}], got {tuple(forced.shape)}")
    if v == 0:
        raise ValueError("masked_argmax: x has no columns")
    if bitmask.shape[0] != m or bitmask.shape[1] * 32 < v:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} must have {m} rows of at least {-(-v // 32)} words")
    if bitmask.stride(-1) != 1:
        raise ValueError("bitmask needs unit stride in its last dim")
    tokens = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return tokens
    p, val, idx = _partials(m, v, x.device)
    cnt = torch.empty_like(idx)
    # launched plainly: before it the compute stream waits for the grammar branch's mask, not for a kernel
    _masked_block_max_kernel[(m, p)](x, bitmask, val, idx, cnt, x.stride(0), bitmask.stride(0), p, v,
                                     BLOCK_V=BLOCK_V, num_warps=4)
    return first_max(val, idx, tokens, counts=cnt, forced=forced)


def first_max(val: torch.Tensor, idx: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor | None = None,
              counts: torch.Tensor | None = None, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel 2 on partials val [M, P] float32 and idx [M, P] int32 (contiguous) into tokens [M] int64 (mapped
    through ids where given, as checked by check_ids); with masked_argmax's allowed counts [M, P] and forced [M]."""
    m, p = val.shape
    block = min(triton.next_power_of_2(p), BLOCK_P)
    _first_max_kernel[(m,)](val, idx, tokens if ids is None else ids, tokens, idx if counts is None else counts,
                            tokens if forced is None else forced, val.stride(0), p, BLOCK_P=block,
                            HAS_IDS=ids is not None, MASKED=counts is not None, FORCED=forced is not None,
                            num_warps=min(16, max(4, block // 512)),
                            **pdl(_first_max_kernel, val.device, m))
    return tokens
