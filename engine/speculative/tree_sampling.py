"""Lossless speculative sampling over a draft tree (engine/speculative/tree.py): a sampled row's emitted tokens are
distributed as sampling the target one token at a time, as engine/speculative/verify.py rejection_sample keeps them
for a chain.

Drafts are deterministic (one-hot proposals). The chain's draft j passes with probability p_{j-1}(x_j), the
target's distribution at the input before it. Where the chain stops at depth a + 1, its rejected draft x is taken
out of p_a (the residual, renormalized), and that depth's leaves are tried in their input order: leaf y passes with
probability r(y) / sum(r) under the current residual r, which then loses y if it fails. This is the chain's rule
applied to one candidate after another at a node, as multi-candidate speculative sampling does. A passed leaf's
row emits one token more, drawn from p at the leaf. A row whose leaves all fail draws its token from the last
residual; one that accepted every draft it may draws its bonus token from p.

Randomness is verify.py's counter hash on its two salted streams: at depth j (position j - 1), lane 0 decides the
chain's draft and lane r the leaf of rank r; the emitted token at position i races exponentials of position i.
"""
from __future__ import annotations

import torch

from engine.speculative.tree import LEAF, TreeTables, tree_accept
from engine.speculative.verify import _ACCEPT_SALT, _RESIDUAL_SALT, PAD, _accepted, _draws, target_probs


def tree_rejection_sample(drafts, target_logits, num_drafts, tables: TreeTables, temperature, top_k, top_p, seeds,
                          steps, leaf_ok=None):
    """drafts [S, N] (the chain's D, then the leaves), target_logits [S, N + 1, V], num_drafts [S] (the deepest a row
    may accept), sampling parameters [S] as rejection_sample's, leaf_ok as tree_accept's -> (accepted, tokens, best,
    leaf) as tree_accept's. Rows of temperature 0 are tree_accept's."""
    tree = tables.tree
    n, d = tree.nodes, tree.depth
    S, _, V = target_logits.shape
    if tuple(drafts.shape) != (S, n) or target_logits.shape[1] != n + 1:
        raise ValueError(f"a tree of {n} drafts samples drafts [S, {n}] against target_logits [S, {n + 1}, V], got "
                         f"{tuple(drafts.shape)} and {tuple(target_logits.shape)}")
    greedy = tree_accept(drafts, target_logits.argmax(dim=-1), num_drafts, tables, leaf_ok)
    cap = num_drafts.clamp(0, d)
    p = target_probs(target_logits, temperature, top_k, top_p)                      # [S, N + 1, V]
    drafts = drafts.long().clamp(0, V - 1)
    lanes = 1 + max(r for _, r in tree.leaves)
    u = _draws(seeds, steps, d, lanes, _ACCEPT_SALT)                                # [S, D, lanes]
    chain = drafts[:, :d]
    a = _accepted(u[:, :, 0] < p[:, :d].gather(2, chain[..., None])[..., 0], cap)
    stopped = a < cap                                                               # the chain's draft a + 1 failed
    at = p.gather(1, a[:, None, None].expand(S, 1, V))[:, 0]                        # p at chain input a
    failed = chain.gather(1, a.clamp(max=d - 1)[:, None])
    resid = torch.where(stopped[:, None], at.scatter(1, failed, 0.0), at)
    leaf = torch.zeros_like(stopped)
    best = a.clone()
    for i, (depth, rank) in enumerate(tree.leaves):
        y = drafts[:, d + i:d + i + 1]
        trying = stopped & ~leaf & (a + 1 == depth)
        if leaf_ok is not None:
            trying &= leaf_ok[:, i]
        take = trying & (u[:, depth - 1, rank] * resid.sum(-1) < resid.gather(1, y)[:, 0])
        leaf, best = leaf | take, torch.where(take, d + 1 + i, best)
        resid = torch.where((trying & ~take)[:, None], resid.scatter(1, y, 0.0), resid)
    accepted = a + leaf.long()
    at_best = p.gather(1, best[:, None, None].expand(S, 1, V))[:, 0]
    dist = torch.where(stopped[:, None] & ~leaf[:, None], resid, at_best)
    dist = torch.where(dist.sum(-1, keepdim=True) <= 0, at_best, dist)            # p == the tried tokens, rounded
    race = -torch.log(_draws(seeds, steps, d + 1, V, _RESIDUAL_SALT))
    race = race.gather(1, accepted[:, None, None].expand(S, 1, V))[:, 0]
    final = torch.where(dist > 0, dist / race, -1.0).argmax(dim=-1)
    col = torch.arange(n + 1, device=drafts.device)[None, :]
    path = torch.cat([chain, drafts.new_full((S, n + 1 - d), PAD)], dim=1)
    leaf_token = drafts.gather(1, (best - 1).clamp(0, n - 1)[:, None])
    tokens = torch.where(col < a[:, None], path, PAD)
    tokens = torch.where(leaf[:, None] & (col == a[:, None]), leaf_token, tokens)
    tokens = torch.where(col == accepted[:, None], final[:, None], tokens)
    tokens = torch.where(leaf[:, None] & (col == n), LEAF, tokens)
    sampled = temperature > 0
    out = (accepted, tokens, best, leaf)
    return tuple(torch.where(sampled[:, None] if x.dim() == 2 else sampled, x, g) for x, g in zip(out, greedy))
