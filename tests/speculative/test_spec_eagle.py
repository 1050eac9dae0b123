"""The EAGLE head in the engine: its paged drafting equals the dense training-time forward, and speculation with
it leaves greedy output unchanged (the equality tests with the real head are in test_spec_engine.py)."""
import pytest
import torch

from engine.attention import AttentionMetadata
from engine.backend import TorchBackend
from engine.models.llama import LlamaForCausalLM
from engine.models.weights import _init_dummy
from engine.speculative.drafters.base import FeatureContext
from engine.speculative.drafters.eagle import EagleDrafter
from engine.speculative.eagle_head import new_head, unrolled_logits
from engine.speculative.eagle_paged import PagedHead, check_head

TINY = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True)
BS, PAGES = 4, 24


@pytest.fixture(scope="module")
def parts():
    target = LlamaForCausalLM(TINY)
    _init_dummy(target, seed=0)
    target.init_rope(128, torch.device("cpu"))
    with torch.no_grad():                       # a head that drafts something other than one token everywhere
        head = new_head(TINY, torch.float32, torch.device("cpu"), seed=3).requires_grad_(False)
        for p in head.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return target, head


def ctx_for(chunks, feats, toks, tables, caps, last_rows):
    """A step with one chunk (positions [a, b)) per sequence; the rows in last_rows draft from the chunk's end."""
    ids, pos, mapping, cu, lens, last = [], [], [], [0], [], []
    for s, (a, b) in enumerate(chunks):
        for p in range(a, b):
            ids.append(toks[s][p + 1])
            pos.append(p)
            mapping.append(tables[s][p // BS] * BS + p % BS)
        cu.append(cu[-1] + b - a)
        lens.append(b)
        last.append(cu[-1] - 1)
    features = torch.cat([feats[s][a:b] for s, (a, b) in enumerate(chunks)])
    meta = AttentionMetadata(torch.tensor(mapping), torch.tensor(cu, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
                             max(b - a for a, b in chunks), max(lens))
    sel = torch.tensor([last[s] for s in last_rows])
    return FeatureContext(features=features, next_ids=torch.tensor(ids), positions=torch.tensor(pos),
                          meta=meta, last=sel, last_seq=torch.tensor(last_rows),
                          last_valid=torch.ones(len(sel), dtype=torch.bool),
                          kv_cap=torch.tensor(caps))


@pytest.mark.parametrize("k", [1, 4])
def test_paged_drafts_equal_the_dense_unrolled_head(parts, k):
    """Two sequences written over two steps (prompt chunks crossing page boundaries, scattered pages), then K
    drafts from each: draft i equals the argmax of the dense training-time forward's step i at the same position,
    fed the earlier drafts as its tokens."""
    target, head = parts
    check_head(head, TINY)
    gen = torch.Generator().manual_seed(0)
    lengths = [23, 14]
    toks = [torch.randint(0, TINY["vocab_size"], (n + k + 2,), generator=gen).tolist() for n in lengths]
    feats = [torch.randn(n + k + 2, 3 * TINY["hidden_size"], generator=gen) * 3 for n in lengths]
    tables = [[5, 17, 2, 9, 11, 0, 20, 14], [3, 8, 21, 1, 13, 6, 19, 4]]
    paged = PagedHead(head, target, TorchBackend(), PAGES, BS, 128)
    drafter = EagleDrafter(k, paged, BS, 128)
    caps = [len(t) * BS for t in tables]
    with torch.no_grad():
        drafter.observe(ctx_for([(0, 10), (0, 6)], feats, toks, tables, caps, []))
        drafts = drafter.propose(ctx_for([(10, lengths[0]), (6, lengths[1])], feats, toks, tables, caps, [0, 1]))
    assert drafts.num_drafts.tolist() == [k, k]
    for s, n in enumerate(lengths):
        t = n - 1                                   # the last input: drafts guess tokens t + 2 ...
        ids = list(toks[s])
        ids[t + 2:t + 1 + k] = drafts.draft_tokens[s, :k - 1].tolist()
        with torch.no_grad():
            logits = unrolled_logits(head, feats[s][None], target.embed_tokens, torch.tensor([ids]),
                                     target.norm, target.compute_logits, k)
        want = [lg[0, t].argmax().item() for lg in logits]
        assert drafts.draft_tokens[s].tolist() == want


def test_drafts_past_the_pages_write_nothing(parts):
    """A draft position past a sequence's pages (kv_cap) writes no key there: the page after belongs to another
    sequence."""
    target, head = parts
    paged = PagedHead(head, target, TorchBackend(), PAGES, BS, 128)
    drafter = EagleDrafter(4, paged, BS, 128)
    gen = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, TINY["vocab_size"], (12,), generator=gen).tolist()]
    feats = [torch.randn(12, 3 * TINY["hidden_size"], generator=gen)]
    tables = [[7, 3, 5]]                          # page 5 is someone else's: this sequence holds 2 pages (8 tokens)
    with torch.no_grad():
        drafter.propose(ctx_for([(0, 7)], feats, toks, tables, [8], [0]))
    assert paged.k_cache[5].abs().sum() == 0 and paged.k_cache[3].abs().sum() > 0


def test_a_tree_drafts_its_chain_as_a_chain_drafter_does(parts):
    """On the fused backend, where the head's input is one kernel: a tree's chain (each draft step fed the first
    column of the ranked candidates before it, a strided view) equals a chain drafter's drafts, row for row, and
    both equal the torch backend's (float32; drafts of several rows, which a one-row step cannot tell apart)."""
    from conftest import triton_module
    if not triton_module("speculative.head_ops").interpreted():
        pytest.skip("the kernels are built for the GPU; this test's tensors are on the CPU")
    from engine.backend import RoutedBackend
    from engine.speculative.tree import DraftTree
    target, head = parts
    gen = torch.Generator().manual_seed(2)
    lengths, k = [19, 13, 9], 4
    toks = [torch.randint(0, TINY["vocab_size"], (n + k + 2,), generator=gen).tolist() for n in lengths]
    feats = [torch.randn(n + k + 2, 3 * TINY["hidden_size"], generator=gen) * 3 for n in lengths]
    tables = [[5, 17, 2, 9, 11], [3, 8, 21, 1, 13], [6, 19, 4, 0, 20]]
    caps = [len(t) * BS for t in tables]
    drafts = {}
    for backend in ("torch", "fused"):
        for name, tree in (("chain", None), ("tree", DraftTree.of_size(k, 10))):
            paged = PagedHead(head, target, TorchBackend() if backend == "torch" else
                              RoutedBackend(device=torch.device("cpu")), PAGES, BS, 128)
            assert (paged._pair_norm is not None) == (backend == "fused")
            drafter = EagleDrafter(k, paged, BS, 128, tree=tree)
            with torch.no_grad():
                out = drafter.propose(ctx_for([(0, n) for n in lengths], feats, toks, tables, caps, [0, 1, 2]))
            drafts[backend, name] = out.draft_tokens
    for backend in ("torch", "fused"):
        assert torch.equal(drafts[backend, "tree"][:, :k], drafts[backend, "chain"]), backend
    assert torch.equal(drafts["fused", "tree"], drafts["torch", "tree"])
