"""engine.kernels.speculative.tree_finish (a draft-tree step's verification, finish, draft rows, head mapping and leaf
moves in two kernels) against the torch path of engine/runner/tree_step.py verify_tree, bit for bit. Without CUDA
the kernels run in the Triton CPU interpreter (tests/conftest.py)."""
import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import triton_module
from engine.memory.kv_cache import kv_pages
from engine.runner import tree_step
from engine.runner.spec_step import SpecStepProgram
from engine.speculative import tree as tree_mod
from engine.speculative.state import SpecState
from engine.speculative.tree import DraftTree, kv_slab

tf = triton_module("speculative.tree_finish")
DEV = "cpu" if tf.interpreted() else "cuda"
ROWS, VOCAB, SLOTS = 40, 6, 16 * 64


def test_markers_are_the_torch_paths():
    assert tf.PAD == tree_mod.PAD and tf.LEAF == tree_mod.LEAF


def _case(seed, tree, S, pads):
    """S rows of a tree step (the last `pads` graph padding: pool row -1, slots -1) over few token ids, so chains
    stop early and leaves hit often; drafted caps from -1 to past the chain. Buffers hold noise past the step."""
    g = torch.Generator().manual_seed(seed)
    n, real = tree.nodes, S - pads
    T = S * (n + 1)
    target = torch.randint(0, VOCAB, (S, n + 1), generator=g)
    ids = torch.randint(0, VOCAB, (S, n + 1), generator=g)
    ids[:, 1:tree.depth + 1] = torch.where(torch.rand(S, tree.depth, generator=g) < 0.7, target[:, :tree.depth],
                                           ids[:, 1:tree.depth + 1])
    for i, (d, _) in enumerate(tree.leaves):     # leaves holding the target's token at their parent now and then
        leaf = tree.depth + 1 + i
        ids[:, leaf] = torch.where(torch.rand(S, generator=g) < 0.3, target[:, d - 1], ids[:, leaf])
    st = SpecState(ROWS, 64, n, torch.device("cpu"))
    st.last_token.copy_(torch.randint(0, VOCAB, (ROWS + 1,), generator=g))
    st.rejected.copy_(torch.randint(0, n, (ROWS + 1,), generator=g))
    slots = torch.randperm(SLOTS, generator=g)[:T]
    slots[real * (n + 1):] = -1
    dev = dict(smp_row=torch.cat([torch.randperm(ROWS, generator=g)[:real], torch.full((pads + 2,), -1)]),
               logits_indices=torch.cat([torch.arange(0, S * (n + 1), n + 1), torch.zeros(2, dtype=torch.int64)]),
               tok_seq=torch.cat([torch.arange(S).repeat_interleave(n + 1), torch.zeros(3, dtype=torch.int64)]),
               slot_mapping=torch.cat([slots, torch.full((3,), 7)]))
    slot = SimpleNamespace(dev={k: v.to(DEV) for k, v in dev.items()}, spec_out=torch.randint(-5, 99, (S + 2, n + 2),
                           generator=g).to(DEV), sampled=torch.randint(-5, 99, (S + 2,), generator=g).to(DEV))
    for name in ("last_token", "rejected", "history"):
        setattr(st, name, getattr(st, name).to(DEV))
    caches = kv_pages(3, (64, 16, 2, 8), torch.float32, "cpu")
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    caches = [(k.to(DEV), v.to(DEV)) for k, v in caches] if DEV != "cpu" else caches
    drafted = torch.randint(-1, tree.depth + 2, (S,), generator=g).clamp(max=tree.depth)
    return slot, st, caches, ids.flatten().to(DEV), target.to(DEV), drafted.to(DEV)


def _program(tree, st, caches, kernels):
    if DEV != "cpu":        # one buffer on CUDA too, as kv_pages allocates it there
        pages = torch.stack([torch.stack(pair) for pair in caches]).contiguous()
        caches = [(pages[i, 0], pages[i, 1]) for i in range(len(caches))]
    program = SimpleNamespace(state=st, drafter=SimpleNamespace(uses_history=False), kv_caches=caches,
                              kv_slab=kv_slab(caches), tree=tree.tables(DEV), tree_finish=tf if kernels else None)
    program.finish = lambda *a: SpecStepProgram.finish(program, *a)
    return program


def _copy(slot, st, caches):
    st2 = copy.copy(st)
    for name in ("last_token", "rejected", "history"):
        setattr(st2, name, getattr(st, name).clone())
    pages = kv_pages(len(caches), caches[0][0].shape, caches[0][0].dtype, "cpu")
    for (k, v), (k2, v2) in zip(caches, pages):
        k2.copy_(k.cpu())
        v2.copy_(v.cpu())
    return SimpleNamespace(dev={n: x.clone() for n, x in slot.dev.items()}, spec_out=slot.spec_out.clone(),
                           sampled=slot.sampled.clone()), st2, [(k.to(DEV), v.to(DEV)) for k, v in pages]


@pytest.mark.parametrize("depth,nodes,S,pads", [(3, 8, 24, 0), (3, 12, 19, 3), (6, 8, 12, 1), (1, 4, 33, 2)])
def test_kernels_equal_the_torch_path(depth, nodes, S, pads):
    tree = DraftTree.of_size(depth, nodes)
    slot, st, caches, ids, target, drafted = _case(depth * 100 + nodes, tree, S, pads)
    T = ids.shape[0]
    runs = []
    for kernels in (False, True):
        s, state, kv = _copy(slot, st, caches)
        program = _program(tree, state, kv, kernels)
        out = tree_step.verify_tree(program, s, ids, None, target, drafted, S, nodes, T)
        runs.append((out, s, state, program.kv_caches))
    (ref, s0, st0, kv0), (got, s1, st1, kv1) = runs
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)            # tokens
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)            # accepted
    assert (ref[1] > 0).any() and (ref[0][:, nodes] == tf.LEAF).any(), "some rows accept, some a leaf"
    (next0, rows0, head0), (next1, rows1, head1) = ref[2], got[2]
    torch.testing.assert_close(next1, next0, rtol=0, atol=0)
    for a, b in zip(rows1, rows0):
        assert (a is None) == (b is None) and (a is None or torch.equal(a.cpu(), b.cpu()))
    torch.testing.assert_close(head1, head0, rtol=0, atol=0)
    rows = ROWS + (pads <= 1)       # the dummy row takes colliding writes of several padding rows
    for name in ("last_token", "rejected"):
        torch.testing.assert_close(getattr(st1, name)[:rows], getattr(st0, name)[:rows], rtol=0, atol=0)
    torch.testing.assert_close(s1.spec_out, s0.spec_out, rtol=0, atol=0)
    torch.testing.assert_close(s1.sampled, s0.sampled, rtol=0, atol=0)
    for pair0, pair1 in zip(kv0, kv1):
        for c0, c1 in zip(pair0, pair1):
            torch.testing.assert_close(c1, c0, rtol=0, atol=0)


def test_bad_arguments_are_named():
    tree = DraftTree.of_size(3, 8)
    slot, st, caches, ids, target, drafted = _case(1, tree, 4, 0)
    leaf_depths = tree.tables(DEV).leaf_depths
    with pytest.raises(ValueError, match="ids has"):
        tf.tree_finish(slot, st, ids[:-1], target, drafted, leaf_depths, 3)
    with pytest.raises(ValueError, match="leaves"):
        tf.tree_finish(slot, st, ids, target, drafted, leaf_depths[:-1], 3)
    with pytest.raises(ValueError, match="chain of 9"):
        tf.tree_finish(slot, st, ids, target, drafted, leaf_depths, 9)
    with pytest.raises(ValueError, match="slab"):
        tf.move_leaves(torch.zeros(2, 4, 8, device=DEV)[:, :, :4], torch.zeros(1, 2, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="moves must be a contiguous"):   # rows of a wider tensor: misread
        tf.move_leaves(torch.zeros(2, 4, 8, device=DEV), torch.zeros(2, 3, dtype=torch.int64, device=DEV)[:, 1:])


def test_engine_tree_outputs_equal_with_the_kernels(monkeypatch):
    """A tree engine (an untrained head on a tiny model, the Triton backend) gives the same drafts and greedy outputs
    with the finish kernels as without, its tree steps take them, and no KV is left behind."""
    from test_spec_finish import _engine, _run
    calls, real = [], tf.tree_finish
    monkeypatch.setattr(tf, "tree_finish", lambda *a: calls.append(1) or real(*a))
    prompts = [[5, 17, 99, 3, 250, 42, 7, 5, 17, 99], [300, 1, 2, 300, 1], [8, 9, 8, 9, 8]]
    runs = {}
    for on in (False, True):
        runs[on] = _run(_engine("eagle", 2, on, k=2, spec_tree=5), prompts, (6, 5, 7))
        assert bool(calls) == on
    assert runs[True] == runs[False]
