"""Two Triton kernels for the end of a draft-tree step (engine/runner/tree_step.py, Tuning.spec_finish_kernel), as
spec_finish.py's kernel is for a chain's:

- `tree_finish`: engine/speculative/tree.py tree_accept on the target's argmax ids, then what
  SpecStepProgram.finish writes (spec_out, sampled, each row's last token and rejected count), what the draft reads
  of each row, the head's slot mapping (tree_step.head_mapping), and each row's leaf move (source and destination
  slot, -1 for none);
- `move_leaves`: the move itself, every layer's keys and values in one launch over the KV slab (tree.kv_slab).

They compute exactly what the torch path computes (integers and copies only), which stays the reference and the
test oracle. Each program of the first takes a block of rows and their 1 + N inputs, so no program reads another's
writes. The grids depend on shapes only: both are captured in the step's CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import is_interpreted, pdl, pdl_start, reduce_min, wrap_row as _wrap
from engine.kernels.fused_ops import _check_device, _check_entries, _check_tensor
from engine.kernels.speculative.spec_ops import _check_rows

PAD, LEAF = -1, -2      # engine/speculative/verify.py's PAD, tree.py's LEAF (test_tree_finish pins them)
_PAD, _LEAF = tl.constexpr(PAD), tl.constexpr(LEAF)
_I64, _INT = (torch.int64,), (torch.int32, torch.int64)
_BLOCK = 16             # rows one program takes


@triton.jit
def _tree_finish_kernel(ids_ptr, target_ptr, drafted_ptr, leaf_depth_ptr, smp_row_ptr, li_ptr, tok_seq_ptr, map_ptr,
                        tokens_ptr, acc_ptr, last_tok_ptr, rejected_ptr, out_ptr, sampled_ptr, row_last_ptr,
                        row_seq_ptr, row_valid_ptr, head_map_ptr, move_ptr, stride_out, n_rows, n_tok_seq, S,
                        D: tl.constexpr, N: tl.constexpr, W: tl.constexpr, L: tl.constexpr,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < S
    c = tl.arange(0, W)[None, :]
    inputs = ok[:, None] & (c <= N)
    base = i[:, None] * (N + 1) + c
    ids = tl.load(ids_ptr + base, mask=inputs, other=0).to(tl.int64)          # [last token, drafts...]
    target = tl.load(target_ptr + base, mask=inputs, other=0).to(tl.int64)
    cap = tl.minimum(tl.maximum(tl.load(drafted_ptr + i, mask=ok, other=0).to(tl.int64), 0), D)
    # the chain: inputs 1..D; draft j (input j + 1) passes where it equals the target's id at input j
    nxt = tl.load(ids_ptr + base + 1, mask=inputs & (c < N), other=0).to(tl.int64)
    miss = (c >= cap[:, None]) | (nxt != target)
    a = reduce_min(tl.where(miss, c, W), 1).to(tl.int64)                      # the chain's accepted drafts
    # leaves: input D + 1 + l at depth leaf_depth[l], right where the chain stopped one draft before it
    lane = c - (D + 1)
    is_leaf = (lane >= 0) & (lane < L)
    depth = tl.load(leaf_depth_ptr + tl.where(is_leaf, lane, 0), mask=is_leaf, other=0).to(tl.int64)
    at_parent = tl.sum(tl.where(c == a[:, None], target, 0), 1)               # the target's id at input a
    hit = is_leaf & (ids == at_parent[:, None]) & (depth == a[:, None] + 1) & (depth <= cap[:, None])
    first = reduce_min(tl.where(hit, c, W), 1).to(tl.int64)
    leaf = first < W
    best = tl.where(leaf, first, a)
    accepted = a + leaf.to(tl.int64)
    bonus = tl.sum(tl.where(c == best[:, None], target, 0), 1)
    col = c.to(tl.int64)
    tok = tl.where(col < a[:, None], nxt, tl.where(col == a[:, None], at_parent[:, None], _PAD))
    tok = tl.where(leaf[:, None] & (col == accepted[:, None]), bonus[:, None], tok)
    tok = tl.where(leaf[:, None] & (col == N), _LEAF, tok)
    tl.store(tokens_ptr + base, tok, mask=inputs)
    tl.store(acc_ptr + i, accepted, mask=ok)
    drafted = tl.load(drafted_ptr + i, mask=ok, other=0).to(tl.int64)
    tl.store(out_ptr + i[:, None] * stride_out + c, tl.where(col <= N, tok, drafted[:, None]),
             mask=ok[:, None] & (c <= N + 1))
    tl.store(sampled_ptr + i, tl.sum(tl.where(c == 0, target, 0), 1), mask=ok)
    row = _wrap(tl.load(smp_row_ptr + i, mask=ok, other=0), n_rows)
    tl.store(rejected_ptr + row, N - accepted, mask=ok)
    last_tok = tl.where(leaf, bonus, at_parent)
    tl.store(last_tok_ptr + row, tl.maximum(last_tok, 0), mask=ok)
    # what the draft reads of the row, and where the head writes its inputs' keys
    li = tl.load(li_ptr + i, mask=ok, other=0)
    last = li + best
    tl.store(row_last_ptr + i, last, mask=ok)
    tl.store(row_seq_ptr + i, tl.load(tok_seq_ptr + _wrap(last, n_tok_seq), mask=ok, other=0), mask=ok)
    tl.store(row_valid_ptr + i, (tl.load(smp_row_ptr + i, mask=ok, other=0) >= 0).to(tl.uint8), mask=ok)
    slots = tl.load(map_ptr + li[:, None] + c, mask=inputs, other=-1)
    depth_slot = tl.sum(tl.where(c == accepted[:, None], slots, 0), 1)
    head = tl.where(col <= a[:, None], slots, -1)                             # the chain's accepted inputs
    head = tl.where(leaf[:, None] & (col == best[:, None]), depth_slot[:, None], head)
    tl.store(head_map_ptr + li[:, None] + c, head, mask=inputs)
    src = tl.sum(tl.where(c == best[:, None], slots, 0), 1)
    moves = leaf & (src >= 0) & (depth_slot >= 0)
    tl.store(move_ptr + i * 2, tl.where(moves, src, -1), mask=ok)
    tl.store(move_ptr + i * 2 + 1, tl.where(moves, depth_slot, -1), mask=ok)


@triton.jit
def _move_leaves_kernel(slab_ptr, move_ptr, stride_layer, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    r, layer = tl.program_id(0), tl.program_id(1)
    src = tl.load(move_ptr + r * 2)
    dst = tl.load(move_ptr + r * 2 + 1)
    if src >= 0:
        base = slab_ptr + layer.to(tl.int64) * stride_layer
        for start in range(0, WIDTH, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < WIDTH
            tl.store(base + dst * WIDTH + offs, tl.load(base + src * WIDTH + offs, mask=m), mask=m)


def interpreted() -> bool:
    """True when the kernels were built for the Triton CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_tree_finish_kernel)


def _check(slot, state, ids, target, drafted, leaf_depths, depth):
    device = state.rejected.device
    _check_tensor("target", target, 2, _INT, device)
    S, n = target.shape[0], target.shape[1] - 1
    if not target.is_contiguous() or not 0 < depth < n or n > 63:
        raise ValueError(f"target must be a contiguous [S, 1 + N] (a chain of {depth} < N <= 63 drafts), got "
                         f"{tuple(target.shape)}")
    _check_tensor("ids", ids, 1, _I64, device)
    if ids.shape[0] != S * (n + 1) or not ids.is_contiguous():
        raise ValueError(f"ids has {ids.shape[0]} entries, a step of {S} rows of 1 + {n} has {S * (n + 1)}")
    _check_entries("drafted", drafted, S, _INT, device)
    _check_tensor("leaf_depths", leaf_depths, 1, _I64, device)
    if leaf_depths.shape[0] != n - depth:
        raise ValueError(f"a tree of {n} drafts on a chain of {depth} has {n - depth} leaves, got "
                         f"{leaf_depths.shape[0]} leaf depths")
    if state.k != n or slot.spec_out.shape[1] < n + 2 or slot.spec_out.shape[0] < S:
        raise ValueError(f"the pool holds {state.k} drafts a row and spec_out is {tuple(slot.spec_out.shape)}; "
                         f"the step writes {S} rows of {n} drafts")
    _check_rows(slot.dev, ("smp_row", "logits_indices"), S, _I64, device)
    _check_rows(slot.dev, ("tok_seq", "slot_mapping"), ids.shape[0], _I64, device)
    _check_entries("sampled", slot.sampled, S, _I64, device)
    _check_device(device)


def tree_finish(slot, state, ids, target, drafted, leaf_depths, depth: int):
    """A greedy tree step's verification and finish in one launch. ids [S * (1 + N)] int64: each row's last token
    and its N drafts (the chain's `depth`, then the leaves, at `leaf_depths`); target [S, 1 + N]: the target's argmax
    at each input; drafted [S]: the deepest each row may accept. Writes what SpecStepProgram.finish writes into
    `slot` and `state`, and returns (tokens [S, 1 + N], accepted [S], draft rows (last, last_seq, None,
    last_valid), the head's slot mapping [S * (1 + N)], moves [S, 2]: each row's leaf (source, destination) slot,
    -1 where none), as tree_accept, SpecStepProgram.finish, tree_step.head_mapping and move_leaf_kv compute them."""
    _check(slot, state, ids, target, drafted, leaf_depths, depth)
    S, n, device = target.shape[0], target.shape[1] - 1, ids.device
    tokens = torch.empty(S, n + 1, dtype=torch.int64, device=device)
    accepted, last, last_seq = (torch.empty(S, dtype=torch.int64, device=device) for _ in range(3))
    valid = torch.empty(S, dtype=torch.bool, device=device)
    head = torch.empty(ids.shape[0], dtype=torch.int64, device=device)
    moves = torch.full((S, 2), -1, dtype=torch.int64, device=device)
    if S:
        d = slot.dev
        _tree_finish_kernel[(triton.cdiv(S, _BLOCK),)](
            ids, target, drafted, leaf_depths, d["smp_row"], d["logits_indices"], d["tok_seq"], d["slot_mapping"],
            tokens, accepted, state.last_token, state.rejected, slot.spec_out, slot.sampled, last, last_seq,
            valid.view(torch.uint8), head, moves, slot.spec_out.stride(0), state.rejected.shape[0],
            d["tok_seq"].shape[0], S, D=depth, N=n, W=triton.next_power_of_2(n + 2), L=n - depth, BLOCK=_BLOCK,
            num_warps=4, **pdl(_tree_finish_kernel, device, S))
    return tokens, accepted, (last, last_seq, None, valid), head, moves


def move_leaves(slab, moves) -> None:
    """Copy slab[:, source] to slab[:, destination] for each row of moves [S, 2] whose source is not -1: every
    layer's keys and values (slab: tree.kv_slab's [2 * layers, slots, width] view) in one launch."""
    _check_tensor("moves", moves, 2, _I64, slab.device)
    if moves.shape[1] != 2 or not moves.is_contiguous():     # row r's pair is read at offsets 2r, 2r + 1
        raise ValueError(f"moves must be a contiguous [S, 2], got shape {tuple(moves.shape)} strides {moves.stride()}")
    if slab.dim() != 3 or slab.stride(2) != 1 or slab.stride(1) != slab.shape[2]:
        raise ValueError("slab must hold each slot's width contiguously, slot after slot")
    if moves.shape[0]:
        width = slab.shape[2]
        _move_leaves_kernel[(moves.shape[0], slab.shape[0])](
            slab, moves, slab.stride(0), WIDTH=width, BLOCK=min(1024, triton.next_power_of_2(width)), num_warps=4)
