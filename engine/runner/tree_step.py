"""A draft-tree step's own device work (engine/speculative/tree.py), for engine/runner/spec_step.py: RoPE positions by
depth, verification of the tree (greedy, or sampled: engine/speculative/tree_sampling.py; guided rows under their
grammar's masks, which the grammar node fills along the tree) with the accepted leaf's keys moved to their depth,
and what the head writes and drafts from afterwards. Enqueue-only tensor code with shapes fixed by the step's key,
like the rest of the step.

The step's inputs are its rows' 1 + N tokens each; the host wrote every input's position as its KV slot's (the row's
position plus its input index), as for a chain.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.runner.step import first_token
from engine.speculative.tree import TreeTables, kv_slab, move_leaf_kv, tree_accept
from engine.speculative.tree_sampling import tree_rejection_sample


def tree_parts(tree, device, kv_caches, finish_kernel: bool):
    """(the tree's tables, the KV caches as one view or None, the finish kernels' module or None) of a tree engine's
    step program; Nones for a chain."""
    if tree is None:
        return None, None, None
    slab = kv_slab(kv_caches)
    kernels = None
    if finish_kernel and slab is not None:          # Tuning.spec_finish_kernel: the tree's finish in two kernels
        from engine.kernels.speculative import tree_finish as kernels
    return tree.tables(device), slab, kernels


def is_tree_step(tables, K: int, variant) -> bool:
    """Whether a step of K drafts a row verifies the tree; it must then be without extras."""
    tree = tables is not None and K == tables.tree.nodes
    if tree and variant.extras:
        raise RuntimeError("a draft tree verifies rows without logprobs only")
    return tree


def depth_positions(d, T: int, tables: TreeTables) -> None:
    """Move each input's position from its slot's to its RoPE position, the row's plus its depth. The slot mapping
    is computed before this (SpecStepProgram.correct) and keeps the slots."""
    inputs = tables.offsets.shape[0]
    index = torch.arange(T, device=tables.offsets.device) % inputs
    d["positions"][:T].sub_(tables.offsets[index])


def verify_tree(program, slot, ids, logits, target, drafted, S: int, K: int, T: int, greedy: bool = True,
                grammar=None, masked: bool = False):
    """Verification of a tree step's rows (greedy, or `greedy` False: lossless sampling, rows of temperature 0 kept
    greedy) -> (tokens [S, K + 1], accepted [S], what the draft reads: (next token of every input, the rows' (last,
    last_seq, start, last_valid), the head's slot mapping)). grammar, masked: a guided step's, as
    SpecStepProgram.verify's (the caps the grammar node's tree walk wrote)."""
    d = slot.dev
    drafts = ids.view(S, K + 1)[:, 1:]
    lead = leaf_ok = None
    if grammar is not None:
        depth = program.tree.tree.depth
        target, allows, lead, drafted = program.apply_grammar(logits, grammar, drafted, S, K, masked, depth)
        leaf_ok = allows[:, depth + 1:]         # a leaf whose own mask allows nothing is not accepted
    if not greedy:
        params = (d["temperature"][:S], d["top_k"][:S], d["top_p"][:S], d["seeds"][:S], d["steps"][:S])
        accepted, tokens, best, leaf = tree_rejection_sample(drafts, logits.view(S, K + 1, -1), drafted,
                                                             program.tree, *params, leaf_ok=leaf_ok)
        return _finish(program, slot, _first(tokens, lead, d, S), accepted, best, leaf, drafted, S, K, T)
    if target is None:
        target = logits.view(S, K + 1, -1).argmax(dim=-1)
    if grammar is not None:
        accepted, tokens, best, leaf = tree_accept(drafts, target, drafted, program.tree, leaf_ok=leaf_ok)
        return _finish(program, slot, _first(tokens, lead, d, S), accepted, best, leaf, drafted, S, K, T)
    if program.tree_finish is not None:         # Tuning.spec_finish_kernel: the same in two kernels
        kernels, tables = program.tree_finish, program.tree
        tokens, accepted, rows, head, moves = kernels.tree_finish(slot, program.state, ids, target, drafted,
                                                                  tables.leaf_depths, tables.tree.depth)
        kernels.move_leaves(program.kv_slab, moves)
        return tokens, accepted, (target.reshape(-1), rows, head)
    accepted, tokens, best, leaf = tree_accept(drafts, target, drafted, program.tree)
    # an accepted input's next token is the target's there (the next accepted draft, or the row's last token)
    return _finish(program, slot, tokens, accepted, best, leaf, drafted, S, K, T, target.reshape(-1))


def _first(tokens, lead, d, S: int):
    return tokens if lead is None else first_token(tokens, lead, d["forced"][:S])


def _finish(program, slot, tokens, accepted, best, leaf, drafted, S: int, K: int, T: int, next_ids=None):
    d = slot.dev
    program.finish(slot, tokens, accepted, drafted, S, K)
    mapping = d["slot_mapping"][:T]
    row_start = d["logits_indices"][:S]
    move_leaf_kv(program.kv_caches, program.kv_slab, mapping, row_start, accepted, best, leaf)
    last = row_start + best
    rows = (last, d["tok_seq"][last], None, d["smp_row"][:S] >= 0)
    if next_ids is None:
        next_ids = path_next(tokens, accepted, best, leaf, K)
    return tokens, accepted, (next_ids, rows, head_mapping(mapping, row_start, accepted, best, leaf, K))


def path_next(tokens, accepted, best, leaf, K: int):
    """The token after each of the step's inputs on the accepted path [S * (K + 1)]: the chain's input j is followed
    by emitted token j, an accepted leaf by the row's last emitted token (the rest: any token)."""
    j = torch.arange(K + 1, device=tokens.device)[None, :]
    nxt = torch.where(leaf[:, None] & (j == best[:, None]), tokens.gather(1, accepted[:, None]), tokens)
    return nxt.clamp(min=0).reshape(-1)


def head_mapping(mapping, row_start, accepted, best, leaf, K: int):
    """Where the head writes the keys of the step's inputs: the accepted path's at their depth's slot (the chain's
    own, a leaf's that of its depth), nothing for the rest."""
    T = mapping.shape[0]
    tok = torch.arange(T, device=mapping.device)
    row, j = tok // (K + 1), tok % (K + 1)
    lf = leaf[row]
    out = torch.where(j <= accepted[row] - lf.long(), mapping, -1)        # the chain's accepted inputs
    return torch.where(lf & (j == best[row]), mapping[(row_start + accepted)[row]], out)


def head_meta(meta, finished):
    """The head's view of the step's attention metadata: a tree step's head mapping, else the step's."""
    if finished is None or len(finished) < 3:
        return meta
    return replace(meta, slot_mapping=finished[2])
