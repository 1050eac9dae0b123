"""One Triton kernel each for the glue at a plain or guided step's two ends (engine/runner/step.py,
Tuning.step_io_kernels):

- `inputs`: the step's input ids (TokenPool.carried: the host's id, or the pool's last token of the sequence's
  row) and their embedding rows, in place of a gather, a compare, a select and the embedding lookup;
- `emit`: the step's tokens into the slot's `sampled` and each sampling row's pool row (TokenPool.emit: clamped
  to 0, so a failed row's NO_TOKEN still embeds), in place of a copy, a clamp and a scatter.

Both compute exactly what the torch code does (a copy of integers and of embedding rows), which stays the
reference path and the test oracle. Grids depend on shapes only, so a step's CUDA graph captures them. Pool
rows are read as torch indexing reads them: -1 (a graph padding row) is the last, dummy row
(engine/memory/token_pool.py). Speculative steps have their own (engine/kernels/speculative/).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, wrap_row
from engine.kernels.fused_ops import _FLOAT_DTYPES, _check_device, _check_entries, _check_tensor

_I64 = (torch.int64,)
_BLOCK_H = 1024     # embedding columns a program copies at a time
_BLOCK_T = 1024     # tokens an emit program takes


@triton.jit
def _inputs_kernel(in_ptr, carry_ptr, tok_row_ptr, last_ptr, w_ptr, ids_ptr, x_ptr, n_rows, H, stride_w, stride_x,
                   CARRY: tl.constexpr, STORE_IDS: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """Program t: ids[t] (the host's in[t], or with CARRY last[tok_row[t]] where carry[t] >= 0; stored with
    STORE_IDS) and x[t] = w[ids[t]]."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    tok = tl.load(in_ptr + t)
    if CARRY:
        src = tl.load(carry_ptr + t)
        row = wrap_row(tl.load(tok_row_ptr + t), n_rows)
        tok = tl.where(src >= 0, tl.load(last_ptr + row, mask=src >= 0, other=0), tok)
    if STORE_IDS:
        tl.store(ids_ptr + t, tok)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        ok = cols < H
        tl.store(x_ptr + t * stride_x + cols, tl.load(w_ptr + tok * stride_w + cols, mask=ok), mask=ok)


@triton.jit
def _emit_kernel(tok_ptr, sampled_ptr, rows_ptr, last_ptr, n, n_rows, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """sampled[i] = tok[i]; last[rows[i]] = max(tok[i], 0) (rows -1: the dummy row)."""
    pdl_start(USE_PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tok = tl.load(tok_ptr + i, mask=ok, other=0)
    tl.store(sampled_ptr + i, tok, mask=ok)
    row = wrap_row(tl.load(rows_ptr + i, mask=ok, other=0), n_rows)
    tl.store(last_ptr + row, tl.maximum(tok, 0), mask=ok)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_emit_kernel)


def inputs(input_ids, carry_src, tok_row, last_token, weight, n: int, carry: bool = True):
    """The step's first n input ids and their embedding: (ids [n] int64, x [n, H] of weight's dtype), new tensors.
    ids[t] is input_ids[t], or with `carry` last_token[tok_row[t]] where carry_src[t] >= 0 (TokenPool.carried of
    a pool without drafts); x[t] = weight[ids[t]]. Every id must be a row of weight."""
    device = weight.device
    _check_tensor("weight", weight, 2, _FLOAT_DTYPES, device)
    for name, x in (("input_ids", input_ids), ("carry_src", carry_src), ("tok_row", tok_row)):
        _check_entries(name, x, n, _I64, device)
    _check_entries("last_token", last_token, 1, _I64, device)
    _check_device(device)
    ids = torch.empty(n, dtype=torch.int64, device=device)
    return ids, _launch_inputs(input_ids, carry_src, tok_row, last_token, weight, ids, n, bool(carry), True)


def embed(ids, weight):
    """weight[ids] (F.embedding) for ids [n] int64, in the inputs kernel: a speculative step's inputs come from its
    correction kernel (engine/kernels/speculative/spec_ops.py), and torch's lookup of a few rows is a slower launch
    that does not overlap the kernel before it. Every id must be a row of weight."""
    device = weight.device
    _check_tensor("weight", weight, 2, _FLOAT_DTYPES, device)
    _check_entries("ids", ids, 0, _I64, device)
    _check_device(device)
    ids = ids.contiguous()
    return _launch_inputs(ids, ids, ids, ids, weight, ids, ids.shape[0], False, False)


def _launch_inputs(input_ids, carry_src, tok_row, last_token, weight, ids, n: int, carry: bool, store_ids: bool):
    """The inputs kernel on checked tensors -> x [n, H], a new tensor (ids written where store_ids)."""
    x = torch.empty((n, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if n:
        _inputs_kernel[(n,)](input_ids, carry_src, tok_row, last_token, weight, ids, x, last_token.shape[0],
                             weight.shape[1], weight.stride(0), x.stride(0), CARRY=carry, STORE_IDS=store_ids,
                             BLOCK_H=min(_BLOCK_H, triton.next_power_of_2(weight.shape[1])), num_warps=4,
                             **pdl(_inputs_kernel, weight.device, n))
    return x


def emit(tokens, sampled, rows, last_token) -> None:
    """TokenPool.emit and the slot's copy in one launch: sampled[:n] = tokens, last_token[rows[:n]] =
    tokens.clamp(min=0), for the n = len(tokens) sampling rows (rows -1: the dummy, last row)."""
    device = last_token.device
    _check_entries("tokens", tokens, 0, _I64, device)
    n = tokens.shape[0]
    for name, x, least in (("sampled", sampled, n), ("rows", rows, n), ("last_token", last_token, 1)):
        _check_entries(name, x, least, _I64, device)
    _check_device(device)
    if n:
        block = min(_BLOCK_T, triton.next_power_of_2(n))
        _emit_kernel[(triton.cdiv(n, block),)](tokens, sampled, rows, last_token, n, last_token.shape[0], BLOCK=block,
                                              num_warps=4, **pdl(_emit_kernel, device, n))
