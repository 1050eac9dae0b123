"""paged_attention(rope=...): RoPE and the new tokens' KV store inside the attention kernel give the bits of
fused_ops.rope_store_kv followed by paged_attention: the same output and the same cache, at any split count.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
"""
import pytest
import torch

from conftest import triton_module
from engine.models.llama import rope_inv_freq, rope_tables
from test_triton_attention import make_batch

ta = triton_module("attention.paged_attention")
fo = triton_module("fused_ops")

DEV = "cpu" if ta.interpreted() else "cuda"
DTYPES = [torch.float32] if DEV == "cpu" else [torch.float32, torch.bfloat16]


def make_step(q_lens, seq_lens, num_heads, num_kv_heads, head_dim=64, block_size=16, dtype=torch.float32, seed=0):
    """A step whose sequences' last q_lens[i] positions are new: older positions cached, the new slots NaN
    (a kernel reading a new key before storing it gives NaN), q / k / v views of one fused projection."""
    _, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                           DEV, seed=seed)
    positions = torch.cat([torch.arange(n - q, n, device=DEV) for q, n in zip(q_lens, seq_lens)])
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=DEV), torch.tensor(q_lens, device=DEV))
    slots = meta.block_tables[seq, positions // block_size].long() * block_size + positions % block_size
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(positions), width + 8, generator=g, device=DEV).to(dtype)    # + 8: rows not contiguous
    q, k, v = qkv[:, :width].split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    cos, sin = rope_tables(rope_inv_freq({"rope_theta": 10000.0}, head_dim), max(seq_lens) + 1, DEV)
    return dict(q=q.view(-1, num_heads, head_dim), k=k.view(-1, num_kv_heads, head_dim),
                v=v.view(-1, num_kv_heads, head_dim), positions=positions, slots=slots, cos=cos, sin=sin,
                k_cache=k_cache, v_cache=v_cache, cu=meta.cu_seqlens_q, seq_lens=meta.seq_lens,
                tables=meta.block_tables, max_q=max(q_lens))


def both_paths(s, num_splits):
    """(output, k_cache, v_cache) of rope_store_kv + paged_attention, and of paged_attention(rope=...)."""
    scale = s["q"].shape[-1] ** -0.5
    results = []
    for fused in (False, True):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        q, rope = s["q"], (s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["slots"])
        if not fused:
            q, rope = fo.rope_store_kv(q, *rope[:5], kc, vc, s["slots"]), None
        out = ta.paged_attention(q, kc, vc, s["cu"], s["seq_lens"], s["tables"], scale, s["max_q"],
                                 num_splits=num_splits, rope=rope)
        results.append((out, kc, vc))
    return results


def assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)], ids=["gqa3", "mha", "gqa4"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 1, 3]], ids=["decode", "verify"])
def test_fused_rope_gives_the_bits_of_rope_store_kv_then_attention(q_lens, heads, num_splits, dtype):
    s = make_step(q_lens, [37, 5, 70], *heads, dtype=dtype, seed=num_splits)
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = both_paths(s, num_splits)
    assert not out_b.isnan().any(), "a new key was read before it was stored"
    assert_same(out_b, out_a)
    assert_same(kc_b, kc_a)
    assert_same(vc_b, vc_a)


def test_padding_rows_store_nothing():
    """A row with slot -1 writes no cache entry in either path (its own key stays unread garbage in both)."""
    s = make_step([1, 2], [20, 33], 4, 2, seed=5)
    s["slots"] = s["slots"].clone()
    s["slots"][0] = -1
    (out_a, kc_a, vc_a), (out_b, kc_b, vc_b) = both_paths(s, 2)
    assert_same(kc_b, kc_a)
    assert_same(vc_b, vc_a)
    assert_same(out_b[1:], out_a[1:])


def test_bad_rope_arguments_raise():
    s = make_step([1, 1], [9, 12], 4, 2, seed=7)
    args = (s["q"], s["k_cache"], s["v_cache"], s["cu"], s["seq_lens"], s["tables"], 0.125)
    rope = (s["k"], s["v"], s["positions"], s["cos"], s["sin"], s["slots"])
    with pytest.raises(ValueError, match="rope must be"):
        ta.paged_attention(*args, 1, rope=rope[:5])
    with pytest.raises(ValueError, match="one block"):
        ta.paged_attention(*args, 200, rope=rope)                     # a prefill's worth of queries
    with pytest.raises(ValueError, match="positions"):
        ta.paged_attention(*args, 1, rope=rope[:2] + (s["positions"][:1],) + rope[3:])
    assert ta.fuses_rope(9, 3, 4, 16) and not ta.fuses_rope(9, 3, 64, 16)


def test_backend_fuses_where_it_fits_and_falls_back_otherwise(monkeypatch):
    """RoutedBackend.rope_attend takes the fused kernel for one-block steps with the switch on; a prefill, or
    the switch off, runs rope_store_kv then attention, with the same result."""
    from engine.attention import AttentionMetadata
    from engine.backend import RoutedBackend
    calls = []
    real = fo.rope_store_kv
    monkeypatch.setattr(fo, "rope_store_kv", lambda *a: calls.append(1) or real(*a))
    on, off = RoutedBackend(rope_attention=True), RoutedBackend(rope_attention=False)
    for b in (on, off):
        b._k, b.ops = ta, fo                          # the interpreter-built modules of this test file
    s = make_step([1, 2], [20, 33], 4, 2, seed=9)
    meta = AttentionMetadata(s["slots"], s["cu"], s["seq_lens"], s["tables"], s["max_q"], 33)
    outs = []
    for b in (on, off):
        kc, vc = s["k_cache"].clone(), s["v_cache"].clone()
        outs.append(b.rope_attend(s["q"], s["k"], s["v"], s["positions"], (s["cos"], s["sin"]), kc, vc, meta, 0.125))
    assert calls == [1]                                # only the switched-off backend ran the separate kernel
    assert_same(outs[0], outs[1])
    calls.clear()
    meta.max_query_len = 200                           # as a prefill step would bound it
    on.rope_attend(s["q"], s["k"], s["v"], s["positions"], (s["cos"], s["sin"]), s["k_cache"].clone(),
                   s["v_cache"].clone(), meta, 0.125)
    assert calls == [1]
