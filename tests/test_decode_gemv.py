"""engine.kernels.decode_gemv (the few-row decode matmul, weights read before the dependent-launch wait)
against F.linear. Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch
import torch.nn.functional as F

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
    with pytest.raises(ValueError, match="rows"):
        dg.decode_linear(randn(dg.MAX_ROWS + 1, 64, seed=5, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="does not fit"):
        dg.decode_linear(x, randn(32, 63, seed=6, dtype=torch.float32))
    with pytest.raises(ValueError, match="stride"):
        dg.decode_linear(x, randn(64, 32, seed=7, dtype=torch.float32).t())
