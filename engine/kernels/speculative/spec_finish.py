"""One Triton kernel for the end of a greedy speculative step (engine/runner/spec_step.py,
Tuning.spec_finish_kernel):

- `greedy_finish`: engine/speculative/verify.py greedy_accept_ids on the target's argmax ids, then what
  SpecStepProgram.finish writes (the emitted tokens into `slot.spec_out` and `slot.sampled`, each row's last
  token (TokenPool.emit) and rejected count, the n-gram history) and, for a draft head, SpecStepProgram.next_tokens.

It replaces some thirty small torch kernels with one launch and computes exactly what they do (integers only), so
the torch code stays the reference path and the test oracle. The grid depends on shapes only: it is captured in
the step's CUDA graph.

Each program takes a block of the step's S rows and a block of its T = S * (K + 1) inputs. An input's next token
may be an emitted token of any row, so the token section recomputes that row's acceptance from the inputs
instead of reading another program's writes. Pool rows are read as torch indexing reads them: -1 (a graph
padding row) is the last, dummy row (engine/memory/token_pool.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_min, wrap_row as _wrap
from engine.kernels.fused_ops import _check_device, _check_entries, _check_tensor
from engine.kernels.speculative.spec_ops import _check_int, _check_rows

PAD = -1                # engine/speculative/verify.py's PAD, after the emitted tokens (test_spec_finish pins it)
_I32, _I64, _INT = (torch.int32,), (torch.int64,), (torch.int32, torch.int64)
_PAD = tl.constexpr(PAD)
_MAX_BLOCK = 128        # rows and inputs one program takes


@triton.jit
def _accepted(r, ok, drafts_ptr, target_ptr, drafted_ptr, stride, K: tl.constexpr, J: tl.constexpr):
    """Step row r's accepted drafts: the leading run of drafts equal to the target's id, capped at its drafted
    count clamped to [0, K]. Lane j = K always misses, so the first miss is at most K."""
    j = tl.arange(0, J)[None, :]
    n = tl.minimum(tl.maximum(tl.load(drafted_ptr + r, mask=ok, other=0).to(tl.int64), 0), K)
    live = ok[:, None] & (j < n[:, None])
    d = tl.load(drafts_ptr + r[:, None] * stride + j, mask=live, other=0).to(tl.int64)
    t = tl.load(target_ptr + r[:, None] * (K + 1) + j, mask=live, other=0).to(tl.int64)
    return reduce_min(tl.where(live & (d == t), J, j), 1).to(tl.int64)


@triton.jit
def _emitted(r, j, a, ok, drafts_ptr, target_ptr, stride, K: tl.constexpr):
    """tokens[r, j] of greedy_accept_ids: the accepted drafts, the target's id at column a, then PAD."""
    d = tl.load(drafts_ptr + r * stride + j, mask=ok & (j < a), other=0).to(tl.int64)
    t = tl.load(target_ptr + r * (K + 1) + j, mask=ok & (j == a), other=0).to(tl.int64)
    return tl.where(j < a, d, tl.where(j == a, t, _PAD))


@triton.jit
def _finish_rows(i, S, drafts_ptr, target_ptr, drafted_ptr, stride, tokens_ptr, acc_ptr, smp_row_ptr, last_ptr,
                 rejected_ptr, out_ptr, stride_out, sampled_ptr, li_ptr, pos_ptr, hist_ptr, stride_hist, n_rows,
                 n_pos, k_max, max_model_len, K: tl.constexpr, J: tl.constexpr, W: tl.constexpr,
                 HISTORY: tl.constexpr):
    ok = i < S
    a = _accepted(i, ok, drafts_ptr, target_ptr, drafted_ptr, stride, K, J)
    row = _wrap(tl.load(smp_row_ptr + i, mask=ok, other=0), n_rows)
    tl.store(acc_ptr + i, a, mask=ok)
    tl.store(rejected_ptr + row, K - a, mask=ok)
    # tokens[:, 0] and tokens[:, a] are the target's ids there: an accepted draft equals it
    tl.store(sampled_ptr + i, tl.load(target_ptr + i * (K + 1), mask=ok, other=0).to(tl.int64), mask=ok)
    last = tl.load(target_ptr + i * (K + 1) + a, mask=ok, other=0).to(tl.int64)
    tl.store(last_ptr + row, tl.maximum(last, 0), mask=ok)
    c = tl.arange(0, W)[None, :]
    tok = _emitted(i[:, None], c, a[:, None], ok[:, None], drafts_ptr, target_ptr, stride, K)
    tl.store(tokens_ptr + i[:, None] * (K + 1) + c, tok, mask=ok[:, None] & (c <= K))
    drafted = tl.load(drafted_ptr + i, mask=ok, other=0).to(tl.int64)
    out = tl.where(c <= K, tok, tl.where(c <= k_max, _PAD, drafted[:, None]))
    tl.store(out_ptr + i[:, None] * stride_out + c, out, mask=ok[:, None] & (c <= k_max + 1))
    if HISTORY:     # emitted tokens after the first scored position; the rest to the dummy column
        li = _wrap(tl.load(li_ptr + i, mask=ok, other=0), n_pos)
        col = tl.load(pos_ptr + li, mask=ok, other=0)[:, None] + 1 + c
        col = tl.where((c <= a[:, None]) & (col < max_model_len), col, max_model_len)
        tl.store(hist_ptr + row[:, None] * stride_hist + col, tl.maximum(tok, 0).to(tl.int32),
                 mask=ok[:, None] & (c <= K))
    return a


@triton.jit
def _draft_rows(i, S, T, a, li_ptr, pos_ptr, smp_row_ptr, tok_seq_ptr, last_ptr, seq_ptr, start_ptr, valid_ptr,
                n_tok_seq):
    """What a draft head reads of each row (SpecStepProgram.draft): its last verified input li + a, that input's
    sequence and corrected position, and whether the row is real; indices wrap as torch indexing wraps them."""
    ok = i < S
    last = tl.load(li_ptr + i, mask=ok, other=0) + a
    tl.store(last_ptr + i, last, mask=ok)
    tl.store(seq_ptr + i, tl.load(tok_seq_ptr + _wrap(last, n_tok_seq), mask=ok, other=0), mask=ok)
    tl.store(start_ptr + i, tl.load(pos_ptr + _wrap(last, T), mask=ok, other=0), mask=ok)
    tl.store(valid_ptr + i, (tl.load(smp_row_ptr + i, mask=ok, other=0) >= 0).to(tl.uint8), mask=ok)


@triton.jit
def _next_tokens(i, T, S, ids_ptr, src_ptr, next_ptr, drafts_ptr, target_ptr, drafted_ptr, stride,
                 K: tl.constexpr, J: tl.constexpr):
    ok = i < T
    src = tl.load(src_ptr + i, mask=ok, other=0)
    shifted = tl.load(ids_ptr + tl.where(i + 1 < T, i + 1, 0), mask=ok, other=0)
    flat = tl.minimum(tl.maximum(-2 - src, 0), S * (K + 1) - 1)
    r = flat // (K + 1)
    j = flat % (K + 1)
    a = _accepted(r, ok, drafts_ptr, target_ptr, drafted_ptr, stride, K, J)
    emitted = _emitted(r, j, a, ok, drafts_ptr, target_ptr, stride, K)
    tl.store(next_ptr + i, tl.maximum(tl.where(src >= 0, src, tl.where(src == -1, shifted, emitted)), 0), mask=ok)


@triton.jit
def _greedy_finish_kernel(ids_ptr, drafts_ptr, target_ptr, drafted_ptr, tokens_ptr, acc_ptr, smp_row_ptr, last_ptr,
                          rejected_ptr, out_ptr, sampled_ptr, li_ptr, pos_ptr, hist_ptr, src_ptr, next_ptr, tok_seq_ptr,
                          row_last_ptr, row_seq_ptr, row_start_ptr, row_valid_ptr, stride_out, stride_hist, n_rows,
                          n_pos, n_tok_seq, k_max, max_model_len, T, S, K: tl.constexpr, J: tl.constexpr,
                          W: tl.constexpr, HISTORY: tl.constexpr, NEXT: tl.constexpr, ROWS: tl.constexpr,
                          BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = _finish_rows(i, S, drafts_ptr, target_ptr, drafted_ptr, K + 1, tokens_ptr, acc_ptr, smp_row_ptr, last_ptr,
                     rejected_ptr, out_ptr, stride_out, sampled_ptr, li_ptr, pos_ptr, hist_ptr, stride_hist, n_rows,
                     n_pos, k_max, max_model_len, K, J, W, HISTORY)
    if ROWS:
        _draft_rows(i, S, T, a, li_ptr, pos_ptr, smp_row_ptr, tok_seq_ptr, row_last_ptr, row_seq_ptr, row_start_ptr,
                    row_valid_ptr, n_tok_seq)
    if NEXT:
        _next_tokens(i, T, S, ids_ptr, src_ptr, next_ptr, drafts_ptr, target_ptr, drafted_ptr, K + 1, K, J)


def interpreted() -> bool:
    """True when the kernel was built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_greedy_finish_kernel)


def _check_state(state, K, history):
    _check_int("state.k", state.k, K)
    device, rows = state.rejected.device, state.rejected.shape[0]
    _check_tensor("rejected", state.rejected, 1, _I64, device)
    _check_tensor("last_token", state.last_token, 1, _I64, device)
    if state.last_token.shape[0] != rows:
        raise ValueError(f"the pool's rejected and last_token disagree on rows: {rows}, {state.last_token.shape[0]}")
    if history:
        _check_tensor("history", state.history, 2, _I32, device)
        if state.history.shape != (rows, state.max_model_len + 1):
            raise ValueError(f"history is {tuple(state.history.shape)}, expected ({rows}, max_model_len + 1 = "
                             f"{state.max_model_len + 1})")


def _check_slot(slot, state, S, T, history, next_ids, rows):
    device, width = state.rejected.device, state.k + 2
    _check_rows(slot.dev, ("smp_row",) + (("logits_indices", "positions") if history or rows else ()), S, _I64,
                device)
    if rows:
        _check_rows(slot.dev, ("tok_seq", "positions"), T, _I64, device)
    if next_ids:
        _check_rows(slot.dev, ("next_ids",), T, _I64, device)
    _check_tensor("spec_out", slot.spec_out, 2, _I64, device)
    if slot.spec_out.shape[0] < S or slot.spec_out.shape[1] < width:
        raise ValueError(f"spec_out is {tuple(slot.spec_out.shape)}, the step writes {S} rows of {width} columns")
    _check_entries("sampled", slot.sampled, S, _I64, device)


def _check_finish(slot, state, ids, target, drafted, K, history, next_ids, rows):
    _check_int("K", K, 0)
    for name, flag in (("history", history), ("next_ids", next_ids), ("rows", rows)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if history and rows:
        raise ValueError("rows are a draft head's: a drafter with a history has none")
    _check_state(state, K, history)
    device = state.rejected.device
    _check_tensor("ids", ids, 1, _I64, device)
    _check_tensor("target", target, 2, _INT, device)
    S, T = target.shape[0], ids.shape[0]
    if target.shape[1] != K + 1 or not target.is_contiguous():
        raise ValueError(f"target must be a contiguous [S, K + 1 = {K + 1}], got shape {tuple(target.shape)}")
    if T != S * (K + 1):
        raise ValueError(f"ids has {T} entries, a step of {S} rows of K + 1 = {K + 1} has {S * (K + 1)}")
    _check_tensor("drafted", drafted, 1, _INT, device)
    if drafted.shape[0] != S:
        raise ValueError(f"drafted has {drafted.shape[0]} rows, target {S}")
    _check_slot(slot, state, S, T, history, next_ids, rows)
    _check_device(device)


def greedy_finish(slot, state, ids, target, drafted, K: int, history: bool, next_ids: bool, rows: bool = False):
    """A greedy spec step's verification and finish in one launch (K = 0: a plain step of one-token rows, whose
    finish this is too). ids [T = S * (K + 1)] int64: the step's inputs, each row's last token then its K drafts;
    target [S, K + 1] int32 / int64: the target's argmax at each position; drafted [S]: the drafts each row
    verifies. Writes what SpecStepProgram.finish writes into `slot`
    (spec_out, sampled; its dev tensors named as engine/runner/slots.py) and the SpecState `state` (last_token,
    rejected; history with `history`), and returns (tokens [S, K + 1], accepted [S], next ids [T] or None, draft
    rows or None) as new tensors: the first three as greedy_accept_ids and, with `next_ids`, SpecStepProgram.
    next_tokens return them; with `rows` (a draft head's step, not with `history`) what SpecStepProgram.draft
    reads of each row: (last [S] int64, last_seq [S] int64, start [S] int64, last_valid [S] bool)."""
    _check_finish(slot, state, ids, target, drafted, K, history, next_ids, rows)
    S, T, device = target.shape[0], ids.shape[0], ids.device
    tokens = torch.empty(S, K + 1, dtype=torch.int64, device=device)
    accepted = torch.empty(S, dtype=torch.int64, device=device)
    nxt = torch.empty(T, dtype=torch.int64, device=device) if next_ids else None
    drafted_rows = (*(torch.empty(S, dtype=torch.int64, device=device) for _ in range(3)),
                    torch.empty(S, dtype=torch.bool, device=device)) if rows else None
    if not S:
        return tokens, accepted, nxt, drafted_rows
    d = slot.dev
    block = min(_MAX_BLOCK, triton.next_power_of_2(T if next_ids else S))
    hist = state.history if history else tokens
    rows_at = (*drafted_rows[:3], drafted_rows[3].view(torch.uint8)) if rows else (accepted,) * 4
    _greedy_finish_kernel[(triton.cdiv(T if next_ids else S, block),)](
        ids, ids[1:], target, drafted, tokens, accepted, d["smp_row"], state.last_token, state.rejected,
        slot.spec_out, slot.sampled, d["logits_indices"] if history or rows else accepted,
        d["positions"] if history or rows else accepted, hist, d["next_ids"] if next_ids else accepted,
        nxt if next_ids else accepted, d["tok_seq"] if rows else accepted, *rows_at, slot.spec_out.stride(0),
        hist.stride(0), state.rejected.shape[0], d["positions"].shape[0] if history else 1,
        d["tok_seq"].shape[0] if rows else 1, state.k, state.max_model_len if history else 0, T, S,
        K=K, J=triton.next_power_of_2(K + 1), W=triton.next_power_of_2(state.k + 2), HISTORY=history,
        NEXT=next_ids, ROWS=rows, BLOCK=block, num_warps=4, **pdl(_greedy_finish_kernel, device, T))
    return tokens, accepted, nxt, drafted_rows
