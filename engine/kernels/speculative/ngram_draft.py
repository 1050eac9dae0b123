"""N-gram drafting in one Triton kernel: engine/speculative/drafters/ngram.py's `ngram_propose` over rows of a history
table, reading the table in place (Tuning.spec_kernels).

The torch code builds [N, L] match and score tensors in some twenty-five small launches; here one program per row
walks its own valid history in blocks, keeps the best (match length, position) it has seen, and gathers the drafts
after it. Integers only, so it computes exactly what the torch code does, which stays the reference path and the test
oracle. The grid depends on the row count only and the loop on values read on the device: it is captured in the
step's CUDA graph like the rest of the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_max, wrap_row
from engine.kernels.fused_ops import _check_device, _check_tensor

_INTS = (torch.int32, torch.int64)
_BLOCK = 512        # history positions a program compares at a time


@triton.jit
def _ngram_kernel(hist_ptr, stride_hist, rows_ptr, lengths_ptr, drafts_ptr, count_ptr, n_rows, L, k, min_n,
                  MAX_N: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    s = tl.program_id(0)
    row = wrap_row(tl.load(rows_ptr + s).to(tl.int64), n_rows)
    hist = hist_ptr + row * stride_hist
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + s).to(tl.int64), 0), L)
    best = tl.full((), -1, tl.int64)            # match * L + end of the best occurrence so far; -1: none
    # an occurrence ends at e <= n - 2 (before the newest token), so the walk stops there
    for e0 in range(0, n - 1, BLOCK):
        e = e0 + tl.arange(0, BLOCK).to(tl.int64)
        run = e <= n - 2
        match = tl.zeros((BLOCK,), tl.int64)
        for i in tl.static_range(MAX_N):        # run: the i + 1 tokens ending at e equal the row's last i + 1
            suffix = tl.load(hist + tl.maximum(n - 1 - i, 0))
            run = run & (e >= i)
            run = run & (tl.load(hist + e - i, mask=run, other=0) == suffix)
            match += run.to(tl.int64)
        score = tl.where((match >= min_n) & (e <= n - 2), match * L + e, -1)
        best = tl.maximum(best, reduce_max(score, 0))
    start = best % L + 1                        # the first token after the occurrence
    count = tl.where(best >= 0, tl.minimum(tl.maximum(n - start, 0), k), 0)
    o = tl.arange(0, K_PAD)
    draft = tl.load(hist + tl.minimum(start + o, L - 1), mask=o < count, other=0).to(tl.int64)
    tl.store(drafts_ptr + s * k + o, draft, mask=o < k)
    tl.store(count_ptr + s, count)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_ngram_kernel)


def ngram_draft(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int):
    """`ngram_propose(history[rows], lengths, k, min_n, max_n)` without gathering the rows: history [R, L] integer
    token ids (a strided view such as the first L columns of a wider table is read in place), rows [N] integer rows
    of it (-1: the last row, as torch indexing reads it), lengths [N] integer valid tokens per row (clamped into
    [0, L]). -> (drafts [N, k] int64, num_drafts [N] int64), equal to the torch code's."""
    for name, value in (("k", k), ("min_n", min_n), ("max_n", max_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if min_n > max_n:
        raise ValueError(f"need min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    device = history.device
    _check_tensor("history", history, 2, _INTS, device)
    _check_tensor("rows", rows, 1, _INTS, device)
    _check_tensor("lengths", lengths, 1, _INTS, device)
    if lengths.shape != rows.shape:
        raise ValueError(f"rows {tuple(rows.shape)} and lengths {tuple(lengths.shape)} must match")
    _check_device(device)
    n, (table_rows, seq) = rows.shape[0], history.shape
    drafts = torch.zeros(n, k, dtype=torch.int64, device=device)
    count = torch.zeros(n, dtype=torch.int64, device=device)
    if not n or seq < 2 or not table_rows:  # ngram_propose's static case: no occurrence ends before the last token
        return drafts, count
    _ngram_kernel[(n,)](history, history.stride(0), rows, lengths, drafts, count, table_rows, seq, k, min_n,
                        MAX_N=max_n, K_PAD=triton.next_power_of_2(k), BLOCK=min(_BLOCK, triton.next_power_of_2(seq)),
                        num_warps=4, **pdl(_ngram_kernel, device, n))
    return drafts, count
