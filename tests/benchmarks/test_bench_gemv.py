"""bench/kernels/gemv.py (small-M GEMV with a fused RMSNorm / SiLU*up prologue) against its torch references.

Without CUDA the kernels run in the Triton CPU interpreter (tests/conftest.py: triton_module).
The CPU tests also force small blocks so that the K loop, the N grid and their masked tails all run.
"""
import pytest
import torch
import torch.nn.functional as F

from conftest import triton_module
from engine.kernels.fused_ops import rms_norm_ref, silu_mul_ref

pytestmark = pytest.mark.kernels
gv = triton_module("bench.kernels.gemv")

DEV = "cpu" if gv.interpreted() else "cuda"
EPS = 1e-5
# (rtol, atol as a fraction of the output's largest magnitude). fp32: summation order only (K up to 8192 on
# the GPU: measured 1.6e-6 of the scale at K=8192). bf16/fp16: the
# output rounding, plus on the CPU the interpreter's truncating bf16 cast (fused_ops. tests say more) of
# the prologue's roundings, each a ulp of one input that the sum spreads over the output: ~2 ulps.
ULP = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 * 2 ** -7, 2 * 2 ** -8),
       torch.float16: (2 * 2 ** -10, 2 * 2 ** -11)}
# The new residual is one fp32 add rounded once, as torch's: bit-exact except for the interpreter's bf16 cast.
EXACT_RES = {torch.float32: True, torch.float16: True, torch.bfloat16: DEV == "cuda"}
SMALL_BLOCKS = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)  # K=72: 3 chunks; N=48/80: ragged tiles


def randn(*shape, seed, dtype=torch.float32, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(dtype)


def assert_out_close(got, want, dtype, factor=1.0):
    rtol, atol = ULP[dtype]
    scale = want.float().abs().max().item() if want.numel() else 0.0
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=rtol * factor, atol=atol * factor * scale)


def fp32_linear(a, w, b=None):
    """The kernels' matmul semantics: fp32 accumulation of the dtype's values, rounded once."""
    return F.linear(a.float(), w.float(), None if b is None else b.float()).to(a.dtype)


@pytest.fixture(params=["default", "small_blocks"])
def blocks(request, monkeypatch):
    if request.param == "small_blocks":
        monkeypatch.setattr(gv, "gemv_config", lambda m, n, k, dtype: dict(SMALL_BLOCKS))
    return request.param


def norm_case(M, K, N, dtype, seed, bias=False, residual=False, strided=False, device=DEV):
    wide = randn(M, K + 7, seed=seed, dtype=dtype, device=device)
    x = wide[:, 3:3 + K] if strided else wide[:, :K].contiguous()
    return dict(x=x, norm_weight=randn(K, seed=seed + 1, dtype=dtype, device=device), eps=EPS,
                weight=randn(N, K, seed=seed + 2, dtype=dtype, device=device) / K ** 0.5,
                bias=randn(N, seed=seed + 3, dtype=dtype, device=device) if bias else None,
                residual=randn(M, K, seed=seed + 4, dtype=dtype, device=device) if residual else None)


def check_norm_linear(case, dtype):
    out, new_res = gv.norm_linear(**case)
    ref_out, ref_res = gv.norm_linear_ref(**case)
    assert_out_close(out, ref_out, dtype)
    if case["residual"] is None:
        assert new_res is case["x"] and ref_res is case["x"]
    else:
        assert new_res.is_contiguous() and new_res.dtype == dtype
        if EXACT_RES[dtype]:
            torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
        else:
            torch.testing.assert_close(new_res, ref_res, rtol=2 ** -7, atol=0)
    return out


# ---- CPU (interpreter) or GPU: tiny shapes ----

@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,N", [(64, 48), (72, 80)])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_norm_linear_fp32(blocks, M, K, N, bias, residual):
    case = norm_case(M, K, N, torch.float32, seed=M + K, bias=bias, residual=residual)
    out = check_norm_linear(case, torch.float32)
    h = case["x"] if not residual else case["x"] + case["residual"]
    normed = rms_norm_ref(h, case["norm_weight"], EPS)
    assert_out_close(out, F.linear(normed, case["weight"], case["bias"]), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,bias,residual", [(1, False, True), (3, True, False), (16, True, True)])
def test_norm_linear_low_precision(blocks, dtype, M, bias, residual):
    case = norm_case(M, 72, 80, dtype, seed=M, bias=bias, residual=residual, strided=True)
    out = check_norm_linear(case, dtype)
    normed = rms_norm_ref(case["x"], case["norm_weight"], EPS, case["residual"])
    normed = normed[0] if residual else normed
    assert_out_close(out, fp32_linear(normed, case["weight"], case["bias"]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,inter,N", [(1, 64, 48), (3, 72, 80), (16, 72, 48)])
def test_silu_mul_linear(blocks, dtype, M, inter, N):
    gate_up = randn(M, 2 * inter, seed=inter, dtype=dtype) * 2
    weight = randn(N, inter, seed=N, dtype=dtype) / inter ** 0.5
    out = gv.silu_mul_linear(gate_up, weight)
    assert_out_close(out, gv.silu_mul_linear_ref(gate_up, weight), dtype)
    assert_out_close(out, fp32_linear(silu_mul_ref(gate_up), weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,N,bias", [(1, 64, 48, False), (3, 72, 80, True), (16, 72, 48, False)])
def test_linear(blocks, dtype, M, K, N, bias):
    x = randn(M, K + 5, seed=K, dtype=dtype)[:, 2:2 + K]  # strided rows
    weight = randn(N, K, seed=N, dtype=dtype) / K ** 0.5
    b = randn(N, seed=1, dtype=dtype) if bias else None
    out = gv.linear(x, weight, b)
    assert_out_close(out, gv.linear_ref(x, weight, b), dtype)
    assert_out_close(out, fp32_linear(x, weight, b), dtype)


def test_empty_batch():
    case = norm_case(0, 64, 48, torch.float32, seed=0, residual=True)
    out, new_res = gv.norm_linear(**case)
    assert out.shape == (0, 48) and new_res.shape == (0, 64)
    assert gv.silu_mul_linear(randn(0, 16, seed=0), randn(48, 8, seed=1)).shape == (0, 48)
    assert gv.linear(randn(0, 8, seed=0), randn(48, 8, seed=1)).shape == (0, 48)


def test_gemv_config_is_valid_for_all_shapes():
    for n in (1, 48, 576, 960, 3072, 16384, 28672, 60000):
        for k in (1, 72, 576, 4096, 16384):
            for dtype in (torch.float32, torch.bfloat16):
                cfg = gv.gemv_config(16, n, k, dtype)
                assert cfg["BLOCK_N"] >= 16 and cfg["BLOCK_K"] >= 16  # tl.dot's smallest tile
                assert all(cfg[b] & (cfg[b] - 1) == 0 for b in ("BLOCK_N", "BLOCK_K"))


def test_bad_inputs():
    case = norm_case(2, 16, 8, torch.float32, seed=0, residual=True)
    x, nw, w, r = case["x"], case["norm_weight"], case["weight"], case["residual"]
    nl = lambda **kw: gv.norm_linear(**{**case, **kw})  # noqa: E731
    bad = [
        (ValueError, "at most MAX_ROWS=16", lambda: nl(x=randn(17, 16, seed=0), residual=None)),
        (ValueError, "x must be 2-D", lambda: nl(x=x[0])),
        (TypeError, "x dtype must be", lambda: nl(x=x.double())),
        (TypeError, "weight dtype", lambda: nl(weight=w.half())),
        (ValueError, r"expected \[N, 16\]", lambda: nl(weight=w[:, :8].contiguous())),
        (ValueError, "weight must be contiguous", lambda: nl(weight=randn(8, 32, seed=1)[:, :16])),
        (ValueError, "non-empty", lambda: nl(weight=w[:0])),
        (ValueError, "weight is on meta", lambda: nl(weight=w.to("meta"))),
        (ValueError, "norm_weight has 8", lambda: nl(norm_weight=nw[:8])),
        (ValueError, "bias has 3", lambda: nl(bias=randn(3, seed=2))),
        (ValueError, "residual shape", lambda: nl(residual=r[:1])),
        (TypeError, "residual dtype", lambda: nl(residual=r.half())),
        (TypeError, "eps", lambda: nl(eps=torch.tensor(1e-5))),
        (ValueError, "unit stride", lambda: nl(x=x.t().contiguous().t())),
        (ValueError, "must be even", lambda: gv.silu_mul_linear(randn(2, 15, seed=0), w)),
        (ValueError, r"expected \[N, 8\]", lambda: gv.silu_mul_linear(randn(2, 16, seed=0), w)),
        (ValueError, "at most MAX_ROWS", lambda: gv.silu_mul_linear(randn(17, 32, seed=0), w)),
        (ValueError, r"weight is \(8, 16\), expected \[N, 15\]", lambda: gv.linear(randn(2, 15, seed=0), w)),
        (ValueError, "bias has 4", lambda: gv.linear(x, w, randn(4, seed=0))),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()


# ---- GPU: realistic shapes, compiled kernels ----

gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (kernels compiled, not interpreted)")
GPU_DTYPES = [torch.bfloat16, torch.float32]
# (hidden, qkv N, intermediate): SmolLM2-135M and Llama-3.2-1B
GPU_MODELS = {"smollm2": (576, 960, 1536), "llama1b": (2048, 3072, 8192)}
GPU_ROWS = [1, 2, 4, 8, 16]
# vs the *_ref twins, whose cuBLAS matmul (same-dtype output, own reduction order) may add a ulp or two
REF_FACTOR = 2.0


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("model", list(GPU_MODELS))
@pytest.mark.parametrize("M", GPU_ROWS)
def test_gpu_norm_linear(dtype, model, M):
    hidden, qkv, inter = GPU_MODELS[model]
    for n, residual in ((qkv, False), (2 * inter, True)):
        case = norm_case(M, hidden, n, dtype, seed=M + n, bias=n == qkv, residual=residual, device="cuda")
        out, new_res = gv.norm_linear(**case)
        ref_out, ref_res = gv.norm_linear_ref(**case)
        normed = rms_norm_ref(case["x"], case["norm_weight"], EPS, case["residual"])
        assert_out_close(out, fp32_linear(normed[0] if residual else normed, case["weight"], case["bias"]), dtype)
        assert_out_close(out, ref_out, dtype, REF_FACTOR)
        torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("model", list(GPU_MODELS))
@pytest.mark.parametrize("M", GPU_ROWS)
def test_gpu_silu_mul_linear_and_linear(dtype, model, M):
    hidden, _, inter = GPU_MODELS[model]
    gate_up = randn(M, 2 * inter, seed=M, dtype=dtype, device="cuda") * 2
    down = randn(hidden, inter, seed=inter, dtype=dtype, device="cuda") / inter ** 0.5
    out = gv.silu_mul_linear(gate_up, down)
    assert_out_close(out, fp32_linear(silu_mul_ref(gate_up), down), dtype)
    assert_out_close(out, gv.silu_mul_linear_ref(gate_up, down), dtype, REF_FACTOR)
    x = randn(M, hidden, seed=M + 1, dtype=dtype, device="cuda")
    o_proj = randn(hidden, hidden, seed=hidden, dtype=dtype, device="cuda") / hidden ** 0.5
    assert_out_close(gv.linear(x, o_proj), fp32_linear(x, o_proj), dtype)


@pytest.mark.gpu
@gpu
def test_gpu_8b_shape():
    """gate_up of an 8B model: K=4096, N=28672 (a 235 MB weight)."""
    x = randn(4, 4096, seed=0, dtype=torch.bfloat16, device="cuda")
    nw = randn(4096, seed=1, dtype=torch.bfloat16, device="cuda")
    w = randn(28672, 4096, seed=2, dtype=torch.bfloat16, device="cuda") / 64
    out, _ = gv.norm_linear(x, nw, EPS, w)
    assert_out_close(out, fp32_linear(rms_norm_ref(x, nw, EPS), w), torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_gpu_capture_in_cuda_graph():
    case = norm_case(4, 576, 960, torch.bfloat16, seed=0, bias=True, residual=True, device="cuda")
    gate_up = randn(4, 3072, seed=1, dtype=torch.bfloat16, device="cuda")
    down = randn(576, 1536, seed=2, dtype=torch.bfloat16, device="cuda") / 40
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        gv.norm_linear(**case), gv.silu_mul_linear(gate_up, down), gv.linear(gate_up[:, :1536], down)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = gv.norm_linear(**case)
        act = gv.silu_mul_linear(gate_up, down)
        lin = gv.linear(gate_up[:, :1536], down)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_res = gv.norm_linear_ref(**case)
    assert_out_close(out, ref_out, torch.bfloat16, REF_FACTOR)
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
    assert_out_close(act, gv.silu_mul_linear_ref(gate_up, down), torch.bfloat16, REF_FACTOR)
    assert_out_close(lin, gv.linear_ref(gate_up[:, :1536], down), torch.bfloat16, REF_FACTOR)
