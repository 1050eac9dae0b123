"""engine.kernels.decode_gemv (the few-row decode matmul, weights read before the dependent-launch wait)
against F.linear. Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch
import torch.nn.functional as F
import triton

from conftest import triton_module

dg = triton_module("decode_gemv")
DEV = "cpu" if dg.interpreted() else "cuda"
# fp32: summation order only; bf16: one output rounding (and on the CPU the interpreter's truncating cast)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 * 2 ** -7, 2 * 2 ** -8)}


def randn(*shape, seed, dtype):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (4, 72, 100), (3, 1536, 48), (2, 8, 1)])
def test_matches_linear(m, k, n, dtype):
    wide = randn(m, k + 5, seed=1, dtype=dtype)
    x = wide[:, 2:2 + k]                              # strided rows, unit stride in K
    w = randn(n, k, seed=2, dtype=dtype) / k ** 0.5
    got = dg.decode_linear(x, w)
    want = F.linear(x.float(), w.float()).to(dtype)   # fp32 accumulation rounded once, as the kernel
    rtol, atol = TOL[dtype]
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * want.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["first", "residual"])
def test_norm_prologue_matches_norm_then_linear(dtype, residual):
    from engine.kernels.fused_ops import rms_norm_ref
    m, k, n = 3, 72, 40
    x = randn(m, k, seed=11, dtype=dtype) * 3
    res = randn(m, k, seed=12, dtype=dtype) if residual else None
    nw = randn(k, seed=13, dtype=dtype)
    w = randn(n, k, seed=14, dtype=dtype) / k ** 0.5
    got, new_res = dg.decode_norm_linear(x, nw, 1e-5, w, res)
    if residual:
        normed, h = rms_norm_ref(x, nw, 1e-5, res)
        exact = DEV == "cuda" or dtype == torch.float32     # else the interpreter's truncating cast: one ulp
        torch.testing.assert_close(new_res, h, rtol=0 if exact else 2 ** -7, atol=0 if exact else 1e-6)
    else:
        normed, h = rms_norm_ref(x, nw, 1e-5), x
        assert new_res is x
    want = F.linear(normed.float(), w.float()).to(dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=2 * rtol, atol=2 * atol * want.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_prologue_matches_silu_then_linear(dtype):
    from engine.kernels.fused_ops import silu_mul_ref
    gate_up = randn(2, 2 * 48, seed=15, dtype=dtype)
    w = randn(30, 48, seed=16, dtype=dtype) / 48 ** 0.5
    want = F.linear(silu_mul_ref(gate_up).float(), w.float()).to(dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(dg.decode_silu_linear(gate_up, w), want, rtol=2 * rtol,
                               atol=2 * atol * want.float().abs().max().item())
    with pytest.raises(ValueError, match="gate_up"):
        dg.decode_silu_linear(randn(2, 95, seed=17, dtype=dtype), w)


def test_blocks_cover_every_row_and_fit_the_register_budget():
    for n, k in [(960, 576), (49152, 576), (576, 1536), (2048, 8192), (1, 3)]:
        cfg = dg.decode_gemv_config(n, k)
        assert cfg["BLOCK_K"] >= k and cfg["BLOCK_N"] * cfg["BLOCK_K"] <= max(dg._ELEMS, cfg["BLOCK_K"])
        assert cfg["BLOCK_N"] >= 1


def test_supports_and_refusals():
    x, w = randn(2, 64, seed=3, dtype=torch.float32), randn(32, 64, seed=4, dtype=torch.float32)
    assert dg.supports(x, w)
    assert not dg.supports(randn(dg.MAX_ROWS + 1, 64, seed=5, dtype=torch.float32), w)
    assert not dg.supports(x, w.t().contiguous().t())                       # a transposed view
    assert not dg.supports(x, w.to(torch.bfloat16))
    assert dg.supports(randn(2, 128, seed=8, dtype=torch.float32), w, k=64)               # silu: K is half of x
    with pytest.raises(ValueError, match="rows"):
        dg.decode_linear(randn(dg.MAX_ROWS + 1, 64, seed=5, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="does not fit"):
        dg.decode_linear(x, randn(32, 63, seed=6, dtype=torch.float32))
    with pytest.raises(ValueError, match="stride"):
        dg.decode_linear(x, randn(64, 32, seed=7, dtype=torch.float32).t())


def test_backend_takes_the_gemv_for_a_few_rows_and_falls_back_otherwise(monkeypatch):
    """TritonAttention's linears: a few rows without bias go to the decode GEMV, with the results of the separate
    kernels and F.linear; more rows, a bias or the switch off go to those."""
    from engine.attention import TritonAttention
    calls = []
    for name in ("decode_linear", "decode_norm_linear", "decode_silu_linear"):
        real = getattr(dg, name)
        monkeypatch.setattr(dg, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    on, off = TritonAttention(decode_gemv=True), TritonAttention(decode_gemv=False)
    on._gemv = dg                                     # the interpreter-built module of this test file
    x, w = randn(2, 64, seed=20, dtype=torch.float32), randn(24, 64, seed=21, dtype=torch.float32)
    nw, res = randn(64, seed=22, dtype=torch.float32), randn(2, 64, seed=23, dtype=torch.float32)
    gu, wd = randn(2, 128, seed=24, dtype=torch.float32), randn(24, 64, seed=25, dtype=torch.float32)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on.linear(x, w), off.linear(x, w), **close)
    for a, b in zip(on.norm_linear(x, res, nw, 1e-5, w), off.norm_linear(x, res, nw, 1e-5, w)):
        torch.testing.assert_close(a, b, **close)
    torch.testing.assert_close(on.silu_linear(gu, wd), off.silu_linear(gu, wd), **close)
    assert calls == ["decode_linear", "decode_norm_linear", "decode_silu_linear"]
    calls.clear()
    on.linear(randn(dg.MAX_ROWS + 1, 64, seed=26, dtype=torch.float32), w)               # too many rows
    on.linear(x, w, bias=randn(24, seed=27, dtype=torch.float32))                         # a bias
    off.linear(x, w)
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [2, 3, 4, 8])
@pytest.mark.parametrize("op", ["norm", "silu", "none", "add", "argmax"])
def test_all_rows_at_once_give_the_loops_bits(op, m, dtype):
    """The at-once path (steps of 2-4 rows by default) and the loop over rows agree for every prologue and
    epilogue: the same bits in the interpreter; compiled, the product's reduction may sum K in another order, so
    to fp32 rounding (the argmax's rows exactly: the tie sits on a copied weight row)."""
    k, n = 96, 40
    w = randn(n, k, seed=21, dtype=dtype) / k ** 0.5
    x = randn(m, 2 * k if op == "silu" else k, seed=22, dtype=dtype) * 2
    kw = {}
    if op == "norm":
        kw = dict(nw=randn(k, seed=23, dtype=dtype), eps=1e-5, residual=randn(m, k, seed=24, dtype=dtype))
    elif op == "add":
        kw = dict(add=randn(m, n, seed=25, dtype=dtype), epilogue="add")
    elif op == "argmax":
        w[7] = w[30]                                   # a tie across programs: the first row must win in both
        kw = dict(epilogue="argmax")
    prologue = op if op in ("norm", "silu") else "none"
    assert dg.decode_gemv_config(n, k, m)["ROWS"] == (triton.next_power_of_2(m) if m <= 4 else 0)
    loop = dg.launch(x, w, k, prologue, at_once=False, **kw)
    once = dg.launch(x, w, k, prologue, at_once=True, **kw)
    for a, b in zip(loop, once):
        if DEV == "cpu" or a.dtype not in TOL:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=TOL[a.dtype][0], atol=TOL[a.dtype][1] * a.abs().max().item())
