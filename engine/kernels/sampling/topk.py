"""The n largest logits of each row, best first, in two kernels of the dependent-launch chain: a draft tree's
candidates at each depth (engine/speculative/eagle_paged.py PagedHead.top).

    top_rows(x [M, V] float, n) -> int64 [M, n]        (= x.float().topk(n, -1).indices)
    top_rows(x, n, ids [V] int64) -> ids[that]          (a draft vocabulary)

Through torch a tree's candidates at one depth were a cast of the logits to float32, torch's top-k and the map to
token ids, none launched dependently; the chain's drafts take argmax.py's two kernels. Here the candidates take two
as well: kernel 1 gives each program BLOCK_V logits of a row and keeps their n largest (n passes over registers:
take the largest, drop it), kernel 2 merges a row's partials the same way and maps them to token ids.

Order: larger first, and among equal values the lower column first; a NaN ranks above every number (as argmax.py).
torch.topk leaves the order of ties unspecified, so the two agree wherever a row's n + 1 largest are distinct.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_max, reduce_min
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_tensor
from engine.kernels.sampling.argmax import check_ids

BLOCK_V = 1024          # logits of a row per kernel-1 program
MAX_N = 32              # candidates a row, at most (a tree's widest depth)
MAX_PARTIALS = 16384    # kernel 2 holds a row's n partials of every program at once
_NO_COLUMN = tl.constexpr(2147483647)


@triton.jit
def _pop_top(val, col, alive):
    """(the largest alive value, its column, alive without it): the lower column first among equal values.
    Columns are distinct among alive entries; with none alive, (-inf, _NO_COLUMN, alive)."""
    top = reduce_max(tl.where(alive, val, float("-inf")), 0)
    first = reduce_min(tl.where(alive & (val == top), col, _NO_COLUMN), 0)
    return top, first, alive & (col != first)


@triton.jit
def _block_top_kernel(x_ptr, val_ptr, col_ptr, stride_x, stride_p, V, N: tl.constexpr, BLOCK_V: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """val[m, p * N + j], col[m, p * N + j]: the j-th largest of x[m, p * BLOCK_V:(p + 1) * BLOCK_V] and its
    column (NaN as +inf); past the row's end, columns are never taken."""
    pdl_start(USE_PDL)
    m, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = p * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < V
    x = tl.load(x_ptr + m * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    alive = inside
    for j in tl.static_range(N):
        top, first, alive = _pop_top(x, cols, alive)
        tl.store(val_ptr + m * stride_p + p * N + j, top)
        tl.store(col_ptr + m * stride_p + p * N + j, first)


@triton.jit
def _merge_top_kernel(val_ptr, col_ptr, ids_ptr, tok_ptr, stride_p, P, N: tl.constexpr, BLOCK: tl.constexpr,
                      HAS_IDS: tl.constexpr, USE_PDL: tl.constexpr):
    """tok[m, :N]: the columns of row m's N largest partials (val[m, :P], col[m, :P]; a column past the row is
    _NO_COLUMN), in order, or ids[those columns] (HAS_IDS)."""
    pdl_start(USE_PDL)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < P
    val = tl.load(val_ptr + m * stride_p + offs, mask=ok, other=float("-inf"))
    col = tl.load(col_ptr + m * stride_p + offs, mask=ok, other=_NO_COLUMN)
    alive = ok & (col != _NO_COLUMN)
    for j in tl.static_range(N):
        _, first, alive = _pop_top(val, col, alive)
        tok = first.to(tl.int64)
        if HAS_IDS:
            tok = tl.load(ids_ptr + tok)
        tl.store(tok_ptr + m * N + j, tok)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_block_top_kernel)


def supports(device: torch.device, columns: int, n: int) -> bool:
    """Whether top_rows takes rows of `columns` logits on `device` at this n: on CUDA (or the CPU's interpreter),
    1 <= n <= MAX_N and the columns, and a row's partials within MAX_PARTIALS."""
    if device.type != "cuda" and not interpreted():
        return False
    return 1 <= n <= min(MAX_N, columns) and triton.cdiv(columns, BLOCK_V) * n <= MAX_PARTIALS


def top_rows(x: torch.Tensor, n: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, V] (float16, bfloat16 or float32; unit stride in V) -> int64 [M, n]: each row's n largest columns,
    best first (the lower column first among equal values), or ids[those] for ids [V] int64 (contiguous)."""
    _check_tensor("x", x, 2, _FLOAT_DTYPES)
    m, v = x.shape
    if not isinstance(n, int) or not 1 <= n <= min(MAX_N, v):
        raise ValueError(f"top_rows: n must be an int in [1, {min(MAX_N, v)}] for {v} columns, got {n!r}")
    p = triton.cdiv(v, BLOCK_V)
    if p * n > MAX_PARTIALS:
        raise ValueError(f"top_rows: {v} columns at n = {n} leave {p * n} partials a row, over {MAX_PARTIALS}")
    check_ids(ids, v, x.device)
    tokens = torch.empty((m, n), dtype=torch.int64, device=x.device)
    if m == 0:
        return tokens
    val = torch.empty((m, p * n), dtype=torch.float32, device=x.device)
    col = torch.empty((m, p * n), dtype=torch.int32, device=x.device)
    _block_top_kernel[(m, p)](x, val, col, x.stride(0), p * n, v, N=n, BLOCK_V=BLOCK_V, num_warps=4,
                              **pdl(_block_top_kernel, x.device, m))
    block = triton.next_power_of_2(p * n)
    _merge_top_kernel[(m,)](val, col, tokens if ids is None else ids, tokens, p * n, p * n, N=n, BLOCK=block,
                            HAS_IDS=ids is not None, num_warps=min(16, max(4, block // 512)),
                            **pdl(_merge_top_kernel, x.device, m))
    return tokens
