"""Draft trees (engine/speculative/tree.py): the layout, greedy acceptance against a walk of the tree, the move of an
accepted leaf's keys, attention by the tree's masks (torch reference and the Triton kernel), and the budget's
weighing of a tree."""
import random

import pytest
import torch

from conftest import triton_module
from engine.attention import AttentionMetadata, paged_attention_torch
from engine.speculative.budget import DraftBudget
from engine.speculative.tree import LEAF, DraftTree, kv_slab, move_leaf_kv, tree_accept
from engine.speculative.verify import PAD
from engine.memory.kv_cache import kv_pages

ta = triton_module("attention.paged_attention")


def test_layout_chain_first_then_leaves():
    tree = DraftTree.of_size(3, 8)
    assert tree.nodes == 8 and tree.leaves == ((1, 1), (2, 1), (3, 1), (1, 2), (2, 2))
    assert tree.widths() == [3, 3, 2]
    assert tree.input_depths() == [0, 1, 2, 3, 1, 2, 3, 1, 2]
    masks = tree.masks()
    assert masks[:4] == [0b1, 0b11, 0b111, 0b1111]
    assert masks[4] == 0b1 | 1 << 4 and masks[6] == 0b111 | 1 << 6      # leaf (3, 1): root, chain 1 and 2, itself
    assert tree.paths() == {(0,), (0, 0), (0, 0, 0), (1,), (0, 1), (0, 0, 1), (2,), (0, 2)}


@pytest.mark.parametrize("depth,leaves,match", [(0, ((1, 1),), "chain"), (2, (), "leaf"), (2, ((3, 1),), "depth"),
                                                (2, ((1, 2),), "rank 1"), (2, ((1, 1), (1, 1)), "repeat")])
def test_bad_trees_are_refused(depth, leaves, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(depth, leaves)


def walk(drafts, target, cap, tree):
    """Greedy acceptance by following the target's tokens down the tree, one node at a time."""
    depths = tree.input_depths()
    node, out = 0, []
    while True:
        want = target[node]
        children = [i for i in range(1, tree.nodes + 1) if depths[i] == depths[node] + 1 and
                    (i <= tree.depth and node == i - 1 or i > tree.depth and node == depths[i] - 1)]
        hit = [i for i in children if drafts[i - 1] == want and depths[i] <= cap]
        out.append(want)
        if not hit:
            return len(out) - 1, out, node
        node = hit[0]


def test_tree_accept_equals_walking_the_tree():
    tree = DraftTree.of_size(3, 8)
    tables = tree.tables("cpu")
    rng = random.Random(0)
    rows = []
    for _ in range(300):        # few distinct tokens: chains stop early and leaves hit often
        target = [rng.randrange(4) for _ in range(tree.nodes + 1)]
        drafts = [rng.randrange(4) for _ in range(tree.nodes)]
        for d in range(1, 4):    # a row's candidates at one depth are distinct (the head's top-k)
            same = [drafts[d - 1]] + [drafts[3 + i] for i, (ld, _) in enumerate(tree.leaves) if ld == d]
            if len(set(same)) < len(same):
                drafts[d - 1] = 4 + d
        rows.append((drafts, target, rng.randrange(4)))
    drafts, target, cap = (torch.tensor(c) for c in zip(*rows))
    accepted, tokens, best, leaf = tree_accept(drafts, target, cap, tables)
    hits = 0
    for i, (d, t, c) in enumerate(rows):
        a, out, node = walk(d, t, c, tree)
        assert accepted[i] == a and best[i] == node and bool(leaf[i]) == (node > tree.depth)
        assert tokens[i, :a + 1].tolist() == out
        assert (tokens[i, a + 1:tree.nodes] == PAD).all()
        assert tokens[i, tree.nodes] == (LEAF if node > tree.depth else PAD)
        hits += node > tree.depth
    assert 20 < hits < 280


@pytest.mark.parametrize("one_buffer", [True, False])
def test_an_accepted_leaf_moves_its_keys_in_every_layer(one_buffer):
    caches = kv_pages(3, (4, 4, 2, 8), torch.float32, "cpu")
    if not one_buffer:
        caches = [(k.clone(), v.clone()) for k, v in caches]
    for i, pair in enumerate(caches):
        for j, c in enumerate(pair):
            c.copy_(torch.arange(c.numel(), dtype=torch.float32).view(c.shape) + 1000 * (2 * i + j))
    slab = kv_slab(caches)
    assert (slab is not None) == one_buffer
    before = [c.clone() for pair in caches for c in pair]
    # two rows of 1 + 4 inputs at slots 3.. and 9..; a third row is padding
    mapping = torch.tensor([3, 4, 5, 6, 7, 9, 10, 11, 12, 13, -1, -1, -1, -1, -1])
    row_start, accepted, best = torch.tensor([0, 5, 10]), torch.tensor([1, 2, 0]), torch.tensor([4, 2, 0])
    move_leaf_kv(caches, slab, mapping, row_start, accepted, best, torch.tensor([True, False, False]))
    for c, old in zip((c for pair in caches for c in pair), before):
        flat, old = c.view(-1, 16), old.view(-1, 16)
        assert torch.equal(flat[4], old[7])             # the leaf (input 4, slot 7) now at depth 1's slot
        rest = [s for s in range(16) if s != 4]
        assert torch.equal(flat[rest], old[rest])


def tree_batch(tree, seq_lens, num_heads, num_kv_heads, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = tree.nodes + 1
    bs, max_blocks = 16, max(-(-s // 16) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks).int()
    k_cache, v_cache = torch.randn(2, num_blocks, bs, num_kv_heads, 32, generator=g)
    q = torch.randn(n * len(seq_lens), num_heads, 32, generator=g)
    cu = torch.arange(0, n * len(seq_lens) + 1, n, dtype=torch.int32)
    meta = AttentionMetadata(None, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, n, max(seq_lens),
                             tree_masks=tree.tables("cpu").masks)
    return [x.to(device) for x in (q, k_cache, v_cache)], meta


def test_reference_attends_to_ancestors_only():
    """Each new token's output equals causal attention over its context and its ancestors alone."""
    tree = DraftTree.of_size(3, 8)
    (q, k_cache, v_cache), meta = tree_batch(tree, [20, 37], 4, 2)
    out = paged_attention_torch(q, k_cache, v_cache, meta, 0.3)
    n, masks = tree.nodes + 1, tree.masks()
    for s, kv_len in enumerate(meta.seq_lens.tolist()):
        blocks = meta.block_tables[s, :-(-kv_len // 16)].long()
        keys, values = (c[blocks].flatten(0, 1)[:kv_len] for c in (k_cache, v_cache))
        ctx = kv_len - n
        for i in range(n):
            seen = list(range(ctx)) + [ctx + j for j in range(n) if masks[i] >> j & 1]
            sub = AttentionMetadata(None, torch.tensor([0, 1], dtype=torch.int32),
                                    torch.tensor([len(seen)], dtype=torch.int32),
                                    torch.arange(-(-len(seen) // 16), dtype=torch.int32)[None], 1, len(seen))
            pad = -(-len(seen) // 16) * 16 - len(seen)
            kc, vc = (torch.cat([x[seen], x[:pad]]).view(-1, 16, *x.shape[1:]) for x in (keys, values))
            want = paged_attention_torch(q[s * n + i:s * n + i + 1], kc, vc, sub, 0.3)
            torch.testing.assert_close(out[s * n + i], want[0], rtol=1e-5, atol=1e-5)


# 32 query heads a KV head's 2: a query block holds 4 new tokens, so a tree spans blocks
@pytest.mark.parametrize("nodes,num_splits,heads", [(8, 1, 8), (8, 4, 8), (15, 2, 8), (8, 1, 64)])
def test_triton_kernel_masks_the_tree(nodes, num_splits, heads):
    tree = DraftTree.of_size(3, nodes)
    (q, k_cache, v_cache), meta = tree_batch(tree, [20, 70, 33], heads, 2)
    dev = "cpu" if ta.interpreted() else "cuda"
    q, k_cache, v_cache = (x.to(dev) for x in (q, k_cache, v_cache))
    meta = AttentionMetadata(None, *(x.to(dev) for x in (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables)),
                             meta.max_query_len, meta.max_seq_len, meta.tree_masks.to(dev))
    out = ta.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.3,
                             meta.max_query_len, num_splits=num_splits, tree_masks=meta.tree_masks)
    ref = paged_attention_torch(q, k_cache, v_cache, meta, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    causal = paged_attention_torch(q, k_cache, v_cache, AttentionMetadata(*[getattr(meta, f) for f in (
        "slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables", "max_query_len", "max_seq_len")]), 0.3)
    assert not torch.allclose(out, causal, atol=1e-3)


def test_triton_kernel_refuses_bad_masks():
    tree = DraftTree.of_size(3, 8)
    (q, k_cache, v_cache), meta = tree_batch(tree, [20], 4, 2)
    dev = "cpu" if ta.interpreted() else "cuda"
    args = [x.to(dev) for x in (q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables)]
    with pytest.raises(ValueError, match="tree_masks"):
        ta.paged_attention(*args, 0.3, meta.max_query_len, tree_masks=meta.tree_masks[:4].to(dev))
    with pytest.raises(ValueError, match="int64"):
        ta.paged_attention(*args, 0.3, meta.max_query_len, tree_masks=meta.tree_masks.int().to(dev))


def test_budget_weighs_a_tree_by_its_leaves():
    budget = DraftBudget(8, (1, 2, 3, 8), depth=3)
    chain = budget.expected(3)
    for _ in range(40):     # chains stop at draft 2, where a leaf is right every other time
        budget.observe(3, 2, tree=True, leaf=True)
        budget.observe(3, 1, tree=True, leaf=False)
    assert budget.expected(8) > budget.expected(3)
    assert budget.leaf_hits[2] / budget.leaf_seen[2] == pytest.approx(0.5, abs=0.05)
    assert budget.rate(2) < 0.1 and budget.expected(3) < chain
    budget.set_costs({(k, 1): c for k, c in ((0, 1.0), (1, 1.1), (2, 1.15), (3, 1.2), (8, 1.25))})
    assert budget.choose(1) == 8


def test_sampled_tree_keeps_the_target_distribution():
    """A chain of 2 with leaves (1, 1), (2, 1), (1, 2), fixed drafts, 40 000 seeds: the first token is distributed as
    the target's at the root, and the token after it as the target's at the input that holds it (the chain's, a
    leaf's); greedy rows keep tree_accept's tokens."""
    from test_spec_verify import _assert_distributed, _params
    from engine.speculative.tree_sampling import tree_rejection_sample
    tree = DraftTree.of_size(2, 5)
    assert tree.leaves == ((1, 1), (2, 1), (1, 2))
    n, v = 40000, 6
    logits = torch.tensor([[1.0, 0.6, 0.3, 0.1, -0.2, 0.0], [0.2, 0.1, 0.9, 0.4, -0.5, 0.3],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.5, -1.0, 0.2, 0.8, 0.1, 0.0],
                           [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [-0.3, 0.7, 0.0, 0.2, 0.9, 0.1]])
    drafts = torch.tensor([[0, 3, 1, 4, 2]]).expand(n, 5)            # chain 0, 3; leaves 1 (depth 1), 4, 2 (depth 1)
    a, t, best, leaf = tree_rejection_sample(drafts, logits.expand(n, 6, v), torch.full((n,), 2), tree.tables("cpu"),
                                             **_params(n, step=3))
    p = logits.softmax(-1)
    _assert_distributed(t[:, 0], p[0], "first token")
    for first, inp in ((0, 1), (1, 3), (2, 5)):          # the chain's draft, the leaves of rank 1 and 2 at depth 1
        rows = t[:, 0] == first
        assert (a[rows] >= 1).all() and (best[rows] >= inp).all()
        _assert_distributed(t[rows, 1], p[inp], f"the token after {first}")
    assert 0.1 < leaf.float().mean() < 0.6 and (t[leaf, 5] == LEAF).all() and (t[~leaf, 5] == PAD).all()
    greedy = tree_rejection_sample(drafts[:8], logits.expand(8, 6, v), torch.full((8,), 2), tree.tables("cpu"),
                                   **_params(8, temp=0.0))
    for got, want in zip(greedy, tree_accept(drafts[:8], logits.argmax(-1).expand(8, 6), torch.full((8,), 2),
                                             tree.tables("cpu"))):
        assert torch.equal(got, want)
