"""One Triton kernel each for the speculative step's bookkeeping (engine/runner/spec_step.py,
Tuning.spec_kernels):

- `correct`: SpecStepProgram.correct, i.e. the rejected-draft correction of a step's positions, slot mapping,
  seq_lens and sampling steps, its carried input ids (TokenPool.carried) and the history write, and the drafts
  each sampling row verifies (SpecStepProgram.drafted's count);
- `draft_layout`: engine/speculative/drafters/base.py draft_layout, where a paged drafter's K draft forwards sit.

Each replaces some twenty small torch kernels with one launch and computes exactly what they do (integers
only), so the torch code stays the reference path and the test oracle. Grids depend on shapes only: both are
captured in the step's CUDA graph.

Pool rows are read as torch indexing reads them: -1 (a graph padding row) is the last, dummy row
(engine/memory/token_pool.py). Positions are never negative (a sequence's rejected drafts sit past its committed
tokens), so `//` and `%` by the block size are torch's floor ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, unit_stride, wrap_row as _wrap
from engine.kernels.fused_ops import _check_device, _check_entries, _check_tensor

_I32, _I64 = (torch.int32,), (torch.int64,)
_MAX_BLOCK = 1024       # elements of each section one program of `correct` takes
_GATHER_MAX = 4096   # values of a gathered row (a head's queries: heads x head_dim)
_TABLE_COLS = 256       # block-table columns draft_layout copies at a time


@triton.jit
def _correct_tokens(i, T, pos_ptr, shift_ptr, tok_row_ptr, tok_seq_ptr, map_ptr, bt_ptr, stride_bt, in_ptr,
                    carry_ptr, ids_ptr, rejected_ptr, last_ptr, drafts_ptr, stride_drafts, draft_cols, hist_ptr,
                    stride_hist, n_rows, max_model_len, BLOCK_SIZE: tl.constexpr, DRAFTS: tl.constexpr,
                    HISTORY: tl.constexpr):
    ok = i < T
    row = _wrap(tl.load(tok_row_ptr + i, mask=ok, other=0), n_rows)
    shift = tl.load(shift_ptr + i, mask=ok, other=0)
    pos = tl.load(pos_ptr + i, mask=ok, other=0) - tl.load(rejected_ptr + row, mask=ok & (shift > 0), other=0)
    tl.store(pos_ptr + i, pos, mask=ok)
    # the slot mapping and the history read the corrected position from registers, not from memory
    mapping = tl.load(map_ptr + i, mask=ok, other=-1)
    seq = tl.load(tok_seq_ptr + i, mask=ok, other=0)
    page = tl.load(bt_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=ok & (mapping >= 0), other=0).to(tl.int64)
    tl.store(map_ptr + i, tl.where(mapping >= 0, page * BLOCK_SIZE + pos % BLOCK_SIZE, mapping), mask=ok)
    src = tl.load(carry_ptr + i, mask=ok, other=-1)
    host = tl.load(in_ptr + i, mask=ok, other=0)
    last = tl.load(last_ptr + row, mask=ok & (src >= 0), other=0)
    carried = last
    if DRAFTS:      # a pool without drafts (k = 0) carries its last token for every src >= 0
        col = tl.minimum(tl.maximum(src - 1, 0), draft_cols - 1)
        draft = tl.load(drafts_ptr + row * stride_drafts + col, mask=ok & (src > 0), other=0)
        carried = tl.where(src == 0, last, draft)
    ids = tl.where(src < 0, host, carried)
    tl.store(ids_ptr + i, ids, mask=ok)
    if HISTORY:
        tl.store(hist_ptr + row * stride_hist + tl.minimum(pos, max_model_len), ids.to(tl.int32), mask=ok)


@triton.jit
def _correct_kernel(pos_ptr, shift_ptr, tok_row_ptr, tok_seq_ptr, map_ptr, bt_ptr, in_ptr, carry_ptr, ids_ptr,
                    seq_lens_ptr, seq_shift_ptr, steps_ptr, smp_shift_ptr, smp_row_ptr, rejected_ptr, last_ptr,
                    drafts_ptr, hist_ptr, cap_ptr, count_ptr, drafted_ptr, stride_bt, stride_drafts, stride_hist,
                    draft_cols, n_rows, max_model_len, T, B, S, BLOCK_SIZE: tl.constexpr, DRAFTS: tl.constexpr,
                    HISTORY: tl.constexpr, DRAFTED: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _correct_tokens(i, T, pos_ptr, shift_ptr, tok_row_ptr, tok_seq_ptr, map_ptr, bt_ptr, stride_bt, in_ptr,
                    carry_ptr, ids_ptr, rejected_ptr, last_ptr, drafts_ptr, stride_drafts, draft_cols, hist_ptr,
                    stride_hist, n_rows, max_model_len, BLOCK_SIZE, DRAFTS, HISTORY)
    ok = i < B
    shift = tl.load(seq_shift_ptr + i, mask=ok, other=-1)       # the sequence's pool row, or -1: no correction
    rej = tl.load(rejected_ptr + shift, mask=ok & (shift >= 0), other=0)
    tl.store(seq_lens_ptr + i, tl.load(seq_lens_ptr + i, mask=ok, other=0) - rej.to(tl.int32), mask=ok)
    ok = i < S
    shift = tl.load(smp_shift_ptr + i, mask=ok, other=0)
    row = _wrap(tl.load(smp_row_ptr + i, mask=ok, other=0), n_rows)
    rej = tl.load(rejected_ptr + row, mask=ok & (shift > 0), other=0)
    tl.store(steps_ptr + i, tl.load(steps_ptr + i, mask=ok, other=0) - rej, mask=ok)
    if DRAFTED:     # the host's cap on the row's drafts and what the drafter proposed for it
        cap = tl.load(cap_ptr + i, mask=ok, other=0)
        tl.store(drafted_ptr + i, tl.minimum(cap, tl.load(count_ptr + row, mask=ok, other=0)), mask=ok)


@triton.jit
def _gather_row(s, last, src_ptr, out_ptr, stride, width, WIDTH: tl.constexpr):
    c = tl.arange(0, WIDTH)
    tl.store(out_ptr + s * width + c, tl.load(src_ptr + last * stride + c, mask=c < width), mask=c < width)


@triton.jit
def _draft_layout_kernel(start_ptr, seq_ptr, valid_ptr, cap_ptr, bt_ptr, pos_ptr, map_ptr, lens_ptr, table_ptr,
                         cu_ptr, last_ptr, a_ptr, a_out_ptr, b_ptr, b_out_ptr, stride_bt, stride_a, stride_b, width_a,
                         width_b, n_last, max_blocks, offset, max_model_len, S, K: tl.constexpr, K_PAD: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, COLS: tl.constexpr, GATHER: tl.constexpr, WIDTH: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    s = tl.program_id(0)
    if GATHER:      # row `last` of a and b (a head's queries and features), wrapped as torch indexing wraps it
        last = _wrap(tl.load(last_ptr + s), n_last)
        _gather_row(s, last, a_ptr, a_out_ptr, stride_a, width_a, WIDTH)
        _gather_row(s, last, b_ptr, b_out_ptr, stride_b, width_b, WIDTH)
    seq = tl.load(seq_ptr + s)
    start = tl.load(start_ptr + s)
    cap = tl.minimum(tl.load(cap_ptr + seq), max_model_len)
    cap = tl.where(tl.load(valid_ptr + s) != 0, cap, 0)        # a padding row reaches no position
    src = bt_ptr + seq * stride_bt
    for c0 in range(0, max_blocks, COLS):
        c = c0 + tl.arange(0, COLS)
        tl.store(table_ptr + s * max_blocks + c, tl.load(src + c, mask=c < max_blocks), mask=c < max_blocks)
    j = tl.arange(0, K_PAD)
    in_k = j < K
    pos = start + offset + j
    ok = in_k & (pos < cap)
    page = tl.load(src + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1), mask=ok, other=0).to(tl.int64)
    # [K, S] outputs: program s writes column s
    tl.store(map_ptr + j * S + s, tl.where(ok, page * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=in_k)
    tl.store(lens_ptr + j * S + s, tl.where(ok, pos + 1, start + 1).to(tl.int32), mask=in_k)
    tl.store(pos_ptr + j * S + s, tl.minimum(pos, max_model_len), mask=in_k)
    e = tl.arange(0, 2)     # cu_seqlens[s], and the last program writes cu_seqlens[S] too
    tl.store(cu_ptr + s + e, (s + e).to(tl.int32), mask=(e == 0) | (s + e == S))


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_correct_kernel)


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check_block_size(block_size):
    _check_int("block_size", block_size, 1)
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")


def _check_rows(dev, names, n, dtypes, device):
    for name in names:
        if name not in dev:
            raise ValueError(f"the slot has no {name!r} tensor")
        _check_entries(name, dev[name], n, dtypes, device)


def _check_correct(dev, state, T, B, S, block_size, history, drafted=False):
    for name, n in (("T", T), ("B", B), ("S", S)):
        _check_int(name, n, 0)
    _check_block_size(block_size)
    device = state.rejected.device
    _check_rows(dev, ("positions", "shift", "tok_row", "tok_seq", "slot_mapping", "input_ids", "carry_src"), T,
                _I64, device)
    _check_rows(dev, ("seq_shift",), B, _I64, device)
    _check_rows(dev, ("seq_lens",), B, _I32, device)
    _check_rows(dev, ("steps", "smp_shift", "smp_row") + (("num_drafts",) if drafted else ()), S, _I64, device)
    _check_tensor("block_tables", dev.get("block_tables"), 2, _I32, device)
    rows = state.rejected.shape[0]
    _check_tensor("rejected", state.rejected, 1, _I64, device)
    _check_tensor("last_token", state.last_token, 1, _I64, device)
    _check_tensor("drafts", state.drafts, 2, _I64, device)
    _check_tensor("draft_count", state.draft_count, 1, _I64, device)
    if state.draft_count.shape[0] != rows:
        raise ValueError(f"the pool's draft_count has {state.draft_count.shape[0]} rows, rejected {rows}")
    if state.last_token.shape[0] != rows or state.drafts.shape[0] != rows:
        raise ValueError(f"the pool's rejected, last_token and drafts disagree on rows: {rows}, "
                         f"{state.last_token.shape[0]}, {state.drafts.shape[0]}")
    if history:
        _check_tensor("history", state.history, 2, _I32, device)
        if state.history.shape != (rows, state.max_model_len + 1):
            raise ValueError(f"history is {tuple(state.history.shape)}, expected ({rows}, max_model_len + 1 = "
                             f"{state.max_model_len + 1})")
    _check_device(device)


def correct(dev, state, T: int, B: int, S: int, block_size: int, history: bool, drafted: bool = False):
    """SpecStepProgram.correct in one launch: for the step's T tokens, B sequences and S sampling rows of the
    slot's device tensors `dev` (engine/runner/slots.py names) and the SpecState `state`, positions, slot_mapping,
    seq_lens and steps move back by each one's rejected drafts (in place), and the step's input ids
    (TokenPool.carried) are returned as a new [T] int64 tensor; with `history` they are written to
    state.history at the corrected positions (clamped to max_model_len, the dummy column). With `drafted`, returns
    (ids, drafted): also each sampling row's drafts to verify, a new [S] int64 tensor (num_drafts capped by the
    row's draft_count)."""
    _check_correct(dev, state, T, B, S, block_size, history, drafted)
    ids = torch.empty_like(dev["input_ids"][:T])
    counts = torch.empty_like(dev["steps"][:S]) if drafted else None
    n = max(T, B, S)
    if not n:
        return (ids, counts) if drafted else ids
    block = min(_MAX_BLOCK, triton.next_power_of_2(n))
    bt, drafts = dev["block_tables"], state.drafts
    hist = state.history if history else ids
    _correct_kernel[(triton.cdiv(n, block),)](
        dev["positions"], dev["shift"], dev["tok_row"], dev["tok_seq"], dev["slot_mapping"], bt, dev["input_ids"],
        dev["carry_src"], ids, dev["seq_lens"], dev["seq_shift"], dev["steps"], dev["smp_shift"], dev["smp_row"],
        state.rejected, state.last_token, drafts, hist, dev["num_drafts"] if drafted else ids,
        state.draft_count if drafted else ids, ids if counts is None else counts, bt.stride(0), drafts.stride(0),
        hist.stride(0), drafts.shape[1], state.rejected.shape[0], state.max_model_len if history else 0, T, B, S,
        BLOCK_SIZE=block_size, DRAFTS=state.k > 0, HISTORY=bool(history), DRAFTED=bool(drafted), BLOCK=block,
        num_warps=4, **pdl(_correct_kernel, ids.device, T))
    return (ids, counts) if drafted else ids


def _check_layout(ctx, start, offset, k, block_size, max_model_len):
    _check_int("offset", offset, 0)
    _check_int("k", k, 1)
    _check_int("max_model_len", max_model_len, 1)
    _check_block_size(block_size)
    _check_tensor("start", start, 1, _I64)
    device, n = start.device, start.shape[0]
    for name, x, dtypes in (("last_seq", ctx.last_seq, _I64), ("last_valid", ctx.last_valid, (torch.bool,))):
        _check_tensor(name, x, 1, dtypes, device)
        if x.shape[0] != n:
            raise ValueError(f"{name} has {x.shape[0]} rows, start {n}")
    _check_tensor("kv_cap", ctx.kv_cap, 1, _I64, device)
    _check_tensor("block_tables", ctx.meta.block_tables, 2, _I32, device)
    if not ctx.meta.block_tables.shape[1]:
        raise ValueError("block_tables has no columns")
    _check_device(device)


def gathers(ctx, rows) -> bool:
    """Whether draft_layout takes `rows` (two [T, ...] tensors to read each row's `last` of) in its launch: both
    of one float dtype on the step's device, each a contiguous run of at most 4096 values a row, and ctx.last
    [S] int64 of unit stride (the kernel reads row s's at offset s)."""
    if len(rows) != 2 or any(not isinstance(x, torch.Tensor) or x.dim() < 2 for x in rows):
        return False
    a, b, last = *(x.flatten(1) for x in rows), ctx.last
    return (a.dtype == b.dtype and a.dtype.is_floating_point and a.shape[0] == b.shape[0] and a.stride(1) == 1
            and b.stride(1) == 1 and max(a.shape[1], b.shape[1]) <= _GATHER_MAX and a.device == b.device ==
            last.device and last.dtype == torch.int64 and last.dim() == 1
            and unit_stride(last))


def draft_layout(ctx, start, offset: int, k: int, block_size: int, max_model_len: int, rows=()):
    """The tensors of engine/speculative/drafters/base.py draft_layout in one launch: (positions [K, S], slot mappings
    [K, S], seq_lens [K, S] int32, the rows' gathered block tables [S, max_blocks], cu_seqlens [S + 1], and each
    of `rows` indexed by ctx.last where `gathers` takes them, else ())."""
    _check_layout(ctx, start, offset, k, block_size, max_model_len)
    gather = bool(rows) and gathers(ctx, rows)
    n, bt = start.shape[0], ctx.meta.block_tables
    max_blocks, device = bt.shape[1], start.device
    pos = torch.empty(k, n, dtype=torch.int64, device=device)
    mapping = torch.empty_like(pos)
    seq_lens = torch.empty(k, n, dtype=torch.int32, device=device)
    table = torch.empty(n, max_blocks, dtype=torch.int32, device=device)
    cu = torch.empty(n + 1, dtype=torch.int32, device=device) if n else torch.zeros(1, dtype=torch.int32, device=device)
    out = tuple(torch.empty((n, *x.shape[1:]), dtype=x.dtype, device=device) for x in rows) if gather else ()
    if gather:      # (last, a, a_out, b, b_out, stride_a, stride_b, width_a, width_b, n_last), WIDTH
        (a, b), (a_out, b_out) = (x.flatten(1) for x in rows), (x.view(n, -1) for x in out)
        gather_args = (ctx.last, a, a_out, b, b_out, a.stride(0), b.stride(0), a.shape[1], b.shape[1], a.shape[0])
        width = triton.next_power_of_2(max(a.shape[1], b.shape[1]))
    else:           # never read: any pointers and sizes
        gather_args, width = (start,) * 5 + (0,) * 5, 1
    if n:
        _draft_layout_kernel[(n,)](
            start, ctx.last_seq, ctx.last_valid.view(torch.uint8), ctx.kv_cap, bt, pos, mapping, seq_lens, table,
            cu, *gather_args[:5], bt.stride(0), *gather_args[5:], max_blocks, offset, max_model_len, n, K=k,
            K_PAD=triton.next_power_of_2(k), BLOCK_SIZE=block_size,
            COLS=min(_TABLE_COLS, triton.next_power_of_2(max_blocks)), GATHER=gather, WIDTH=width, num_warps=1,
            **pdl(_draft_layout_kernel, device, n))
    return pos, mapping, seq_lens, table, cu, out
