"""verify_attention (a few new tokens a sequence; metadata, RoPE rows and the first cached tile read before the
dependent-launch wait, the new keys' tile from registers) against paged_attention(rope=...): the same cache bits and
the same output to fp32 rounding, at any split count, merged in the kernel or by the combine kernel.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch

from conftest import triton_module
from helpers import record_drafts
from test_rope_attention import DEV, DTYPES, make_step

ta = triton_module("attention.paged_attention")
va = triton_module("attention.verify_attention")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def both(s, num_splits, semaphores=False, prefetch_tiles=0, tree_masks=None):
    """(output, k_cache, v_cache) of paged_attention(rope=...) and of verify_attention on copies of the cache."""
    scale = s["q"].shape[-1] ** -0.5
    results = []
    for verify in (False, True):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        sem = torch.zeros(64, dtype=torch.int32, device=DEV) if semaphores else None
        if verify:
            out = va.verify_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], kc, vc, s["cu"],
                                      s["seq_lens"], s["tables"], s["slots"], scale, s["max_q"],
                                      num_splits=num_splits, semaphores=sem, prefetch_tiles=prefetch_tiles,
                                      tree_masks=tree_masks)
        else:
            rope = (s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["slots"])
            out = ta.paged_attention(s["q"], kc, vc, s["cu"], s["seq_lens"], s["tables"], scale, s["max_q"],
                                     num_splits=num_splits, rope=rope, tree_masks=tree_masks)
        if sem is not None:
            assert not sem.any(), "the merge leaves its counters at zero"
        results.append((out, kc, vc))
    return results


def assert_agree(results, dtype=torch.float32, rows=slice(None)):
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = results
    assert not out_b[rows].isnan().any(), "a new key was read from the cache before it was stored"
    torch.testing.assert_close(kc_b, kc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc_b, vc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_b[rows], out_a[rows], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)], ids=["gqa3", "mha", "gqa4"])
def test_matches_paged_attention_with_rope(heads, num_splits, dtype):
    """Verification widths 1-7 at contexts of only the new keys, within a tile, across a tile's edge and across
    several tiles."""
    s = make_step([7, 4, 1, 7, 2, 7], [7, 37, 64, 65, 130, 200], *heads, dtype=dtype, seed=num_splits)
    assert_agree(both(s, num_splits), dtype)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_splits_merged_in_the_kernel(num_splits):
    s = make_step([4, 4, 4], [70, 5, 130], 9, 3, seed=7)
    assert_agree(both(s, num_splits, semaphores=True))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_two_tiles_before_the_wait(num_splits):
    """A split's second cached tile read before the wait too: paged_attention's output at contexts ending in the
    first tile, on the second's edge and past it."""
    s = make_step([3] * 5, [37, 65, 128, 131, 200], 9, 3, seed=11 + num_splits)
    assert_agree(both(s, num_splits, prefetch_tiles=2))


def test_wide_heads_and_thirty_two_new_tokens():
    """Llama 8B's heads (128 wide, 4 queries a KV head) and the widest step the kernel takes (32 tokens)."""
    s = make_step([32, 9], [32, 150], 8, 2, head_dim=128, seed=3)
    assert_agree(both(s, 2, semaphores=True))


def test_padding_sequences_and_rows():
    """A sequence without a token (its cu_seqlens entry repeated) is skipped; a row with slot -1 stores nothing."""
    s = make_step([3, 2], [20, 33], 4, 2, seed=6)
    s["slots"] = s["slots"].clone()
    s["slots"][0] = -1
    s["seq_lens"] = torch.cat([s["seq_lens"], s["seq_lens"].new_tensor([5])])     # a third sequence, no token
    s["cu"] = torch.cat([s["cu"], s["cu"][-1:]])
    s["tables"] = torch.cat([s["tables"], s["tables"][:1]])
    assert_agree(both(s, 2), rows=slice(3, None))     # the first sequence's rows read the key slot -1 left out


@pytest.mark.parametrize("num_splits", [1, 4])
def test_draft_tree_matches_paged_attention(num_splits):
    """A draft tree of 17 new tokens (16 drafts) a sequence, positions by depth: each new key is seen only by the
    tokens whose mask names it, as paged_attention(tree_masks=...) sees it."""
    parents = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 13]
    masks, depth = [], []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | 1 << i)
        depth.append(depth[p] + 1 if p >= 0 else 0)
    s = make_step([17, 17], [17, 150], 9, 3, seed=21)
    ctx = (s["seq_lens"] - 17).tolist()
    s["positions"] = torch.tensor([c + d for c in ctx for d in depth], device=DEV)
    tree = torch.tensor(masks, dtype=torch.int64, device=DEV)
    assert_agree(both(s, num_splits, tree_masks=tree))


@pytest.mark.parametrize("max_q", [33, 0])
def test_refuses_steps_it_cannot_take(max_q):
    s = make_step([2, 1], [20, 33], 4, 2, seed=8)
    with pytest.raises(ValueError, match="new tokens a sequence"):
        va.verify_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["k_cache"],
                            s["v_cache"], s["cu"], s["seq_lens"], s["tables"], s["slots"], 0.125, max_q)
    assert va.supports(4, 2, 32, 16) and not va.supports(32, 1, 8, 16)      # 32 queries a KV head: 4 tokens a block


@pytest.mark.parametrize("tree", [0, 8])
def test_engine_eagle_outputs_and_drafts_equal_with_verify_attention(tree):
    """A whole engine with an untrained EAGLE head (K = 3: verification steps of four tokens a sequence, whose
    metadata the draft layout wrote kernels earlier; or a tree of 8 drafts, nine tokens): verify_attention on gives
    the drafts and greedy outputs of it off, and its verification steps take the kernel."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from helpers import INTERPRETER_SETTINGS
    results = []
    for on in (False, True):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, depth=2, max_num_seqs=4, max_model_len=64, enforce_eager=True,
                        speculative="eagle", spec_head="random", num_speculative_tokens=3, spec_min_acceptance=0.0,
                        spec_tree=tree, verify_attention=on)
        eng.runner.backend._verify_attn = va if on else None     # this file's (interpreter-built) module
        calls, drafts, real = [], record_drafts(eng.runner.program.drafter), va.verify_attention
        va.verify_attention = lambda *a, **kw: calls.append(a[13]) or real(*a, **kw)
        try:
            seqs = eng.generate([[5, 17, 99, 3], [300, 1, 2], [7, 7, 7, 7, 8]],
                                [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 3, 6)])
        finally:
            va.verify_attention = real
        assert ((1 + (tree or 3)) in calls) == on
        results.append(([s.output_token_ids for s in seqs], [d.draft_tokens.tolist() for d in drafts]))
    assert results[1] == results[0]


@pytest.mark.parametrize("seqs", [va.MAX_SEQS, va.MAX_SEQS + 1])
def test_backend_routes_steps_of_few_sequences(seqs):
    """The routed backend sends a verification step here up to MAX_SEQS sequences and to paged_attention past
    them, with the same output either way."""
    from types import SimpleNamespace
    from engine.attention import AttentionMetadata
    from engine.backend import RoutedBackend
    s = make_step([3] * seqs, [21 + i for i in range(seqs)], 4, 2, seed=seqs)
    backend = RoutedBackend(rope_attention=True, verify_attention=True, device=DEV)
    calls = []
    backend._k = ta                                 # this file's (interpreter-built) modules
    backend._verify_attn = SimpleNamespace(
        preferred=va.preferred, supports=va.supports,
        verify_attention=lambda *a, **kw: calls.append(len(a[9])) or va.verify_attention(*a, **kw))
    meta = AttentionMetadata(s["slots"], s["cu"], s["seq_lens"], s["tables"], s["max_q"], int(s["seq_lens"].max()))
    kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
    out = backend.rope_attend(s["q"], s["k"], s["v"], s["positions"], (s["cos"], s["sin"]), kc, vc, meta, 0.125)
    assert calls == ([seqs] if seqs <= va.MAX_SEQS else [])
    (want, want_k, _), _ = both(s, None)
    torch.testing.assert_close(kc, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
