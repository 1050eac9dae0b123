"""Draft trees: a step verifies the head's first-choice chain of D drafts and, beside it, leaves of the
head's next choices at chosen depths, in one target forward.

A row's 1 + N inputs are laid out chain first: input 0 is the row's last token (the root), inputs 1..D the chain
(depth i at input i), then the leaves, each (depth d, rank r): the head's choice r (0: its first) at depth d,
whose parent is chain input d - 1. Every input attends to the row's context and to its ancestors among the
inputs (`masks`); its RoPE position is the row's position plus its depth, while its KV is written at the
row's position plus its input index, as every step writes it. This is the acceptance study's best tree
restricted to branches that end at once (docs/acceptance.md): the head expands its first choice only, so
drafting a tree costs no more head steps than the chain.

Verification (greedy): the chain accepts its leading run of drafts equal to the target's argmax, a; where it
stops at depth a + 1 <= the row's cap, a leaf at that depth holding the target's token there is accepted too,
and the row emits one token more (the target's at the leaf). The leaf's keys then move from its input slot to
depth a + 1's (`move_leaf_kv`), so the next step finds the sequence's keys in position order.

Because the chain comes first, a step verifying k <= D drafts of a tree engine is a chain step on the
first k drafts: logprobs rows verify chains, while a step of other rows verifies the tree (sampled rows:
tree_sampling.py). A guided row's grammar walks the tree (engine/guided/matching.py walk_tree): every input's
mask is its path's, so a leaf the grammar rejects can never equal the target's token at its parent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.speculative.verify import PAD, greedy_accept_ids

LEAF = -2   # tokens[:, N] of a tree step whose row accepted a leaf (never a token: at most D + 1 < N + 1 emitted)


@dataclass(frozen=True)
class DraftTree:
    depth: int                               # D: the chain's drafts
    leaves: tuple[tuple[int, int], ...]      # (depth, rank) of each leaf, in input order after the chain

    def __post_init__(self):
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"a draft tree needs a chain of at least one draft, got depth {self.depth!r}")
        if not self.leaves:
            raise ValueError("a draft tree needs at least one leaf beside its chain (else it is a chain)")
        if len(set(self.leaves)) != len(self.leaves):
            raise ValueError(f"draft tree leaves repeat: {self.leaves}")
        for d, r in self.leaves:
            if not (1 <= d <= self.depth and r >= 1):
                raise ValueError(f"leaf (depth {d}, rank {r}) must lie at depth 1..{self.depth} with rank >= 1")
        for d, r in self.leaves:
            if r > 1 and (d, r - 1) not in self.leaves:
                raise ValueError(f"leaf (depth {d}, rank {r}) needs the leaf of rank {r - 1} at its depth")

    @classmethod
    def of_size(cls, depth: int, nodes: int) -> "DraftTree":
        """A chain of `depth` and nodes - depth leaves: the second choice at every depth (shallow first), then the
        third, ... (the order of the acceptance study's fitted trees, whose leaves are second choices first)."""
        if not isinstance(nodes, int) or nodes <= depth:
            raise ValueError(f"a tree of {nodes!r} drafts needs more than its chain of {depth}")
        leaves = [(d, r) for r in range(1, nodes) for d in range(1, depth + 1)][:nodes - depth]
        return cls(depth, tuple(leaves))

    @property
    def nodes(self) -> int:
        """N: drafts a row holds (and inputs past its last token a tree step verifies)."""
        return self.depth + len(self.leaves)

    def widths(self) -> list[int]:
        """Candidates the head ranks at each depth 1..D: its first choice and the leaves' ranks."""
        return [1 + max([r for d, r in self.leaves if d == depth] or [0]) for depth in range(1, self.depth + 1)]

    def paths(self) -> frozenset:
        """The tree as rank paths (specdec/acceptance/trees.py's form): (0,) * d for the chain, (0,) * (d - 1) + (r,)
        for a leaf."""
        chain = {(0,) * d for d in range(1, self.depth + 1)}
        return frozenset(chain | {(0,) * (d - 1) + (r,) for d, r in self.leaves})

    def input_depths(self) -> list[int]:
        """Depth of each of the 1 + N inputs (the root's is 0)."""
        return list(range(self.depth + 1)) + [d for d, _ in self.leaves]

    def masks(self) -> list[int]:
        """Bit j of input i's mask: input i attends to input j (its ancestors and itself)."""
        chain = [(1 << (i + 1)) - 1 for i in range(self.depth + 1)]
        return chain + [((1 << d) - 1) | (1 << (self.depth + 1 + i)) for i, (d, _) in enumerate(self.leaves)]

    def tables(self, device) -> "TreeTables":
        depths = self.input_depths()
        return TreeTables(
            self, torch.tensor(self.masks(), dtype=torch.int64, device=device),
            torch.tensor([i - d for i, d in enumerate(depths)], dtype=torch.int64, device=device),
            torch.tensor([d for d, _ in self.leaves], dtype=torch.int64, device=device))


def config_tree(config) -> DraftTree | None:
    """The draft tree an EngineConfig's steps verify (Tuning.spec_tree), or None for a chain."""
    nodes = config.tuning.spec_tree
    return DraftTree.of_size(config.num_speculative_tokens, nodes) if nodes else None


@dataclass(frozen=True)
class TreeTables:
    """A tree's tables on the engine's device, read inside the step's graph."""
    tree: DraftTree
    masks: torch.Tensor         # [1 + N] int64: AttentionMetadata.tree_masks
    offsets: torch.Tensor       # [1 + N] int64: input index - depth (an input's RoPE position is its slot's minus it)
    leaf_depths: torch.Tensor   # [N - D] int64


def tree_accept(drafts, target, num_drafts, tables: TreeTables, leaf_ok=None):
    """Greedy verification of a tree: drafts [S, N] (the chain's D, then the leaves), target [S, N + 1] (the
    target's argmax at each input), num_drafts [S] (the deepest a row may accept), leaf_ok [S, N - D] bool or None
    (a leaf that is False is never accepted: its guided row's mask there allows nothing)
    -> (accepted [S], tokens [S, N + 1], best [S]: the input of the deepest accepted draft (0: none), leaf [S] bool).
    tokens holds the emitted tokens, then PAD; LEAF at column N where a leaf was accepted."""
    tree = tables.tree
    n, d = tree.nodes, tree.depth
    if drafts.dim() != 2 or drafts.shape[1] != n or tuple(target.shape) != (drafts.shape[0], n + 1):
        raise ValueError(f"a tree of {n} drafts verifies drafts [S, {n}] against target [S, {n + 1}], got "
                         f"{tuple(drafts.shape)} and {tuple(target.shape)}")
    chain, tokens = greedy_accept_ids(drafts[:, :d], target[:, :d + 1], num_drafts)
    depths = tables.leaf_depths[None, :]
    parents = target.gather(1, (depths - 1).expand(drafts.shape[0], -1))            # the target's token there
    hits = (drafts[:, d:] == parents) & (chain[:, None] == depths - 1) & (depths <= num_drafts[:, None])
    if leaf_ok is not None:
        hits &= leaf_ok
    leaf = hits.any(dim=1)
    first = hits.long().argmax(dim=1)                                               # the first leaf that hit
    best = torch.where(leaf, d + 1 + first, chain)
    accepted = chain + leaf.long()
    bonus = target.gather(1, best[:, None])
    col = torch.arange(n + 1, device=drafts.device)[None, :]
    tokens = torch.cat([tokens, tokens.new_full((drafts.shape[0], n - d), PAD)], dim=1)
    tokens = torch.where(leaf[:, None] & (col == accepted[:, None]), bonus, tokens)
    tokens = torch.where(leaf[:, None] & (col == n), LEAF, tokens)
    return accepted, tokens, best, leaf


def kv_slab(kv_caches):
    """The caches [(k, v)] per layer as one [2 * layers, slots, width] view where they are views of one buffer
    at even strides (engine/memory/kv_cache.py kv_pages allocates them so), else None."""
    first = kv_caches[0][0]
    if not first.is_contiguous():
        return None
    size = first.numel()
    flat = [t for pair in kv_caches for t in pair]
    if any(not t.is_contiguous() or t.shape != first.shape or t.dtype != first.dtype or
           t.data_ptr() != first.data_ptr() + i * size * t.element_size() for i, t in enumerate(flat)):
        return None
    slots = first.shape[0] * first.shape[1]
    return first.as_strided((len(flat), slots, first[0, 0].numel()), (size, first[0, 0].numel(), 1))


def move_leaf_kv(kv_caches, slab, mapping, row_start, accepted, best, leaf) -> None:
    """Move each leaf-accepting row's keys and values from the leaf's input slot to its depth's slot, in every
    layer (`slab`: kv_slab's view, or None to go layer by layer). mapping [T]: the step's slot mapping;
    row_start [S]: each row's first input. Rows without a leaf copy their root slot onto itself; padding rows
    (slot -1) copy the largest root slot onto itself, which no other row writes."""
    root = mapping[row_start]
    spare = root.max().clamp(min=0)
    dst = torch.where(leaf, mapping[row_start + accepted], root)
    src = torch.where(leaf, mapping[row_start + best], root)
    dst, src = torch.where(dst >= 0, dst, spare), torch.where(src >= 0, src, spare)
    if slab is not None:
        slab[:, dst] = slab[:, src]
        return
    for pair in kv_caches:
        for cache in pair:
            flat = cache.view(-1, *cache.shape[2:])
            flat[dst] = flat[src]
