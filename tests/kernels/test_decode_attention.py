"""decode_attention (one new token a sequence; metadata, RoPE rows and the first cached tile read before the
dependent-launch wait, the new key's term from registers) against paged_attention(rope=...): the same cache bits
and the same output to fp32 rounding, at any split count, merged in the kernel or by the combine kernel.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch

from conftest import triton_module
from helpers import record_drafts
from test_rope_attention import DEV, DTYPES, make_step

ta = triton_module("attention.paged_attention")
da = triton_module("attention.decode_attention")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def both(s, num_splits, semaphores=False):
    """(output, k_cache, v_cache) of paged_attention(rope=...) and of decode_attention on copies of the cache."""
    scale = s["q"].shape[-1] ** -0.5
    results = []
    for decode in (False, True):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        sem = torch.zeros(64, dtype=torch.int32, device=DEV) if semaphores else None
        if decode:
            out = da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], kc, vc, s["cu"],
                                      s["seq_lens"], s["tables"], s["slots"], scale, num_splits=num_splits,
                                      semaphores=sem)
        else:
            rope = (s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["slots"])
            out = ta.paged_attention(s["q"], kc, vc, s["cu"], s["seq_lens"], s["tables"], scale, 1,
                                     num_splits=num_splits, rope=rope)
        if sem is not None:
            assert not sem.any(), "the merge leaves its counters at zero"
        results.append((out, kc, vc))
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)], ids=["gqa3", "mha", "gqa4"])
def test_matches_paged_attention_with_rope(heads, num_splits, dtype):
    """Contexts of 1 key (only the new one), within a tile, on a tile's last key and across several tiles."""
    s = make_step([1] * 5, [1, 37, 64, 65, 200], *heads, dtype=dtype, seed=num_splits)
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = both(s, num_splits)
    assert not out_b.isnan().any(), "a new key was read from the cache before it was stored"
    torch.testing.assert_close(kc_b, kc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc_b, vc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_b, out_a, **TOL[dtype])


@pytest.mark.parametrize("merge", [False, True])
def test_wide_heads_run_eight_warps_and_match_paged_attention(monkeypatch, merge):
    """Llama 8B's heads (128 wide, 4 queries a KV head) launch on 8 warps, SmolLM2's (64) on the tile config's 4;
    the 8-warp layout gives paged_attention's output and cache bits, split and merged either way."""
    assert (da.warps(128, 4), da.warps(256, 4), da.warps(64, 4)) == (8, 8, 4)
    real, launched = da._decode_attn_kernel, []

    class Spy:                  # records each launch's num_warps, then launches the real kernel
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(kw["num_warps"]) or real[grid](*a, **kw)

    monkeypatch.setattr(da, "_decode_attn_kernel", Spy())
    s = make_step([1] * 3, [9, 64, 150], 8, 2, head_dim=128, seed=11)
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = both(s, 4, semaphores=merge)
    assert launched == [8]
    torch.testing.assert_close(kc_b, kc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc_b, vc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_b, out_a, **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_splits_merged_in_the_kernel(num_splits):
    """A launch of num_splits splits: short contexts hold keys in fewer (1 to 5 here, a split takes whole tiles); the
    others return at once and the merge counts only the active ones, leaving its counters at zero."""
    s = make_step([1] * 4, [70, 5, 130, 600], 9, 3, seed=7)
    (out_a, _, _), (out_b, _, _) = both(s, num_splits, semaphores=True)
    torch.testing.assert_close(out_b, out_a, **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 2])
def test_two_tiles_before_the_wait_give_the_same_bits(num_splits):
    """prefetch_tiles=2 reads each split's second cached tile before the wait too and takes it as the loop would:
    the same output and cache bits as one tile, at contexts ending in the first tile, on the second's edge and past
    it, and paged_attention's output to fp32 rounding."""
    s = make_step([1] * 6, [1, 37, 65, 128, 129, 200], 9, 3, seed=11 + num_splits)
    results = []
    for tiles in (1, 2):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        out = da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], kc, vc, s["cu"],
                                  s["seq_lens"], s["tables"], s["slots"], s["q"].shape[-1] ** -0.5,
                                  num_splits=num_splits, prefetch_tiles=tiles)
        results.append((out, kc, vc))
    for one, two in zip(*results):
        torch.testing.assert_close(two, one, rtol=0, atol=0, equal_nan=True)
    (out_a, _, _), _ = both(s, num_splits)
    torch.testing.assert_close(results[1][0], out_a, **TOL[torch.float32])
    with pytest.raises(ValueError, match="prefetch_tiles"):
        da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], kc, vc, s["cu"],
                            s["seq_lens"], s["tables"], s["slots"], 0.125, prefetch_tiles=3)


def test_wide_tiles_match_paged_attention(monkeypatch):
    """A launch the tile rule gives 128-key tiles (one split, by rule one tile before the wait) stores the cache
    bits of paged_attention(rope=...) and its output to fp32 rounding, at contexts within the first tile, on its
    edge and past it."""
    launched, real = [], da._decode_attn_kernel

    class Spy:                  # records each launch's TILE_N and PREFETCH, then launches the real kernel
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append((kw["TILE_N"], kw["PREFETCH"])) or real[grid](*a, **kw)

    monkeypatch.setattr(da, "tile_rule", lambda tile_n, *a: da.WIDE_TILE)
    monkeypatch.setattr(da, "_decode_attn_kernel", Spy())
    s = make_step([1] * 5, [1, 100, 128, 129, 300], 9, 3, seed=17)
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = both(s, 1)
    assert launched == [(da.WIDE_TILE, 1)]
    torch.testing.assert_close(kc_b, kc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc_b, vc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_b, out_a, **TOL[torch.float32])


def test_tile_rule_widens_only_unsplit_full_grids(monkeypatch):
    """128 keys a tile from FULL_GRID programs an SM, unsplit, on CUDA; the tile config's elsewhere."""
    monkeypatch.setattr(da, "sm_count", lambda device: 100)
    cuda, cpu, full = torch.device("cuda"), torch.device("cpu"), da.FULL_GRID * 100
    assert da.tile_rule(64, 1, full, cuda) == da.WIDE_TILE
    assert da.tile_rule(256, 1, full, cuda) == 256
    assert [da.tile_rule(64, 1, full - 1, cuda), da.tile_rule(64, 2, full, cuda), da.tile_rule(64, 1, full, cpu)] \
        == [64] * 3
    assert [da.prefetch_rule(1, 64), da.prefetch_rule(1, da.WIDE_TILE), da.prefetch_rule(2, 64)] == [2, 1, 1]


def test_padding_sequences_and_rows():
    """A sequence without a token (its cu_seqlens entry repeated) is skipped; a row with slot -1 stores nothing."""
    s = make_step([1, 1, 1], [20, 33, 9], 4, 2, seed=5)
    s["slots"] = s["slots"].clone()
    s["slots"][0] = -1
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = both(s, 2)
    torch.testing.assert_close(kc_b, kc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_b[1:], out_a[1:], **TOL[torch.float32])
    s = make_step([1, 1], [20, 33], 4, 2, seed=6)
    s["seq_lens"] = torch.cat([s["seq_lens"], s["seq_lens"].new_tensor([5])])     # a third sequence, no token
    s["cu"] = torch.cat([s["cu"], s["cu"][-1:]])
    s["tables"] = torch.cat([s["tables"], s["tables"][:1]])
    (out_a, kc_a, _), (out_b, kc_b, _) = both(s, 2)
    torch.testing.assert_close(kc_b, kc_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out_b, out_a, **TOL[torch.float32])


def test_refuses_more_than_one_token_a_sequence():
    s = make_step([2, 1], [20, 33], 4, 2, seed=8)
    with pytest.raises(ValueError, match="one token a sequence"):
        da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["k_cache"],
                            s["v_cache"], s["cu"], s["seq_lens"], s["tables"], s["slots"], 0.125)


def test_engine_eagle_outputs_and_drafts_equal_with_decode_attention():
    """A whole engine with an untrained EAGLE head (K = 3: two draft steps of one token a sequence, whose metadata
    the draft layout wrote kernels earlier) and decode steps: decode_attention on gives the drafts and greedy
    outputs of it off, and its steps take the kernel."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from helpers import INTERPRETER_SETTINGS
    results = []
    for on in (False, True):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, depth=2, max_num_seqs=4, max_model_len=64, enforce_eager=True,
                        speculative="eagle", spec_head="random", num_speculative_tokens=3, spec_min_acceptance=0.0,
                        decode_attention=on)
        eng.runner.backend._decode_attn = da if on else None     # this file's (interpreter-built) module
        calls, drafts, real = [], record_drafts(eng.runner.program.drafter), da.decode_attention
        da.decode_attention = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
        try:
            seqs = eng.generate([[5, 17, 99, 3], [300, 1, 2], [7, 7, 7, 7, 8]],
                                [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 3, 6)])
        finally:
            da.decode_attention = real
        assert bool(calls) == on
        results.append(([s.output_token_ids for s in seqs], [d.draft_tokens.tolist() for d in drafts]))
    assert results[1] == results[0]


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_prefetch_by_rule_reads_two_tiles_only_where_the_context_is_not_split(monkeypatch, num_splits):
    """prefetch_tiles=0 (the default) launches the kernel with two tiles before the wait on one split, one on
    more, and gives the bits of that count set by hand."""
    s = make_step([1] * 3, [37, 129, 200], 9, 3, seed=5)
    real, prefetch = da._decode_attn_kernel, []

    class Spy:                  # records the PREFETCH each launch compiles for, then launches the real kernel
        def __getitem__(self, grid):
            return lambda *a, **kw: prefetch.append(kw["PREFETCH"]) or real[grid](*a, **kw)

    outs = []
    for tiles in (0, da.prefetch_rule(num_splits)):
        monkeypatch.setattr(da, "_decode_attn_kernel", Spy())
        outs.append(da.decode_attention(s["q"], s["k"], s["v"], s["positions"], s["cos"], s["sin"],
                                        s["k_cache"].clone(), s["v_cache"].clone(), s["cu"], s["seq_lens"],
                                        s["tables"], s["slots"], 0.125, num_splits=num_splits, prefetch_tiles=tiles))
        monkeypatch.setattr(da, "_decode_attn_kernel", real)
    assert prefetch == [2 if num_splits == 1 else 1] * 2
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_engine_with_decode_attention_splits_and_prefetch_set_keeps_the_tokens(monkeypatch):
    """decode_attention_splits = 4 and decode_attention_prefetch = 1 or 2 reach the kernel on every decode step
    (the rules pick 1 split and 2 tiles on the CPU) and the greedy outputs stay those of the defaults."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    from helpers import INTERPRETER_SETTINGS
    prompts = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2], list(range(40, 140))]    # 100 tokens: past one tile
    results = []
    for splits, tiles in ((0, 0), (4, 1), (0, 2)):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, depth=2, max_num_seqs=4, max_model_len=128, enforce_eager=True,
                        decode_attention=True, decode_attention_splits=splits, decode_attention_prefetch=tiles)
        eng.runner.backend._decode_attn = da                   # this file's (interpreter-built) module
        calls, real = [], da.decode_attention
        monkeypatch.setattr(da, "decode_attention",
                            lambda *a, **kw: calls.append((kw["num_splits"], kw["prefetch_tiles"])) or real(*a, **kw))
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 2, 3)]
        seqs = eng.generate(prompts, params)
        monkeypatch.setattr(da, "decode_attention", real)
        assert calls and set(calls) == {(splits or None, tiles)}
        results.append([s.output_token_ids for s in seqs])
    assert results[1:] == [results[0]] * 2


@pytest.mark.parametrize("splits", [3, 64, -2])
def test_decode_attention_splits_must_be_zero_or_a_power_of_two_to_32(splits):
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="decode_attention_splits"):
        EngineConfig.of(decode_attention_splits=splits)
    assert EngineConfig.of(decode_attention_splits=32).tuning.decode_attention_splits == 32
    for tiles in (-1, 3):
        with pytest.raises(ValueError, match="decode_attention_prefetch"):
            EngineConfig.of(decode_attention_prefetch=tiles)
    assert EngineConfig().tuning.decode_attention_prefetch == 0
