"""engine.kernels.matmul.decode_gemv (the few-row decode matmul, weights read before the dependent-launch wait)
against F.linear. Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch
import torch.nn.functional as F
import triton

from conftest import triton_module

dg = triton_module("matmul.decode_gemv")
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,residual", [(1, False), (3, True)])
def test_silu_epilogue_matches_norm_linear_then_silu_mul(dtype, m, residual):
    """gate_up's GEMV with SiLU * up in its epilogue gives silu_mul of the GEMV's own gate_up (each program pairs
    gate rows with the up rows of the same columns: 5 programs here, the last one ragged), and the same residual."""
    from engine.kernels.fused_ops import silu_mul_ref
    k, inter = 576, 19                                  # BLOCK_N 8: 4 columns a program
    x = randn(m, k, seed=31, dtype=dtype) * 2
    res = randn(m, k, seed=32, dtype=dtype) if residual else None
    nw = randn(k, seed=33, dtype=dtype)
    w = randn(2 * inter, k, seed=34, dtype=dtype) / k ** 0.5
    act, new_res = dg.decode_norm_linear_silu(x, nw, 1e-5, w, res)
    gate_up, want_res = dg.decode_norm_linear(x, nw, 1e-5, w, res)
    want = silu_mul_ref(gate_up)
    assert act.shape == (m, inter) and act.dtype == dtype
    assert torch.equal(new_res, want_res)
    # the kernel's SiLU is g / (1 + exp(-g)), torch's another formula: one rounding apart at most
    torch.testing.assert_close(act, want, rtol=TOL[dtype][0], atol=1e-6)


def test_silu_epilogue_refusals():
    x, nw = randn(1, 64, seed=35, dtype=torch.float32), randn(64, seed=36, dtype=torch.float32)
    assert dg.silu_mul_fits(randn(8, 64, seed=37, dtype=torch.float32))
    assert not dg.silu_mul_fits(randn(7, 64, seed=37, dtype=torch.float32))            # no [gate; up] halves
    assert not dg.silu_mul_fits(torch.empty(8, 8192))                                   # one weight row a program
    with pytest.raises(ValueError, match="even N"):
        dg.decode_norm_linear_silu(x, nw, 1e-5, randn(7, 64, seed=37, dtype=torch.float32))


def test_blocks_cover_every_row_and_fit_the_register_budget():
    for n, k in [(960, 576), (49152, 576), (576, 1536), (2048, 8192), (1, 3)]:
        cfg = dg.decode_gemv_config(n, k)
        assert cfg["BLOCK_K"] >= k and cfg["BLOCK_N"] * cfg["BLOCK_K"] <= max(dg._ELEMS, cfg["BLOCK_K"])
        assert cfg["BLOCK_N"] >= 1


@pytest.mark.parametrize("k, warps", [(576, 4), (2048, 4), (4096, 4), (4097, 8), (8192, 8), (14336, 8)])
def test_warps_by_row_length(k, warps):
    """Four warps up to K = 4096 (Llama 8B's qkv, gate_up and o), eight past it (Llama 1B's and 8B's down)."""
    assert dg.decode_gemv_config(4096, k)["num_warps"] == warps


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
    nw = torch.ones(64, 2, device=x.device)[:, 0]            # the prologue reads norm weight k at offset k
    assert not dg.supports(x, w, norm_weight=nw)
    with pytest.raises(ValueError, match="norm_weight .* unit stride"):
        dg.decode_norm_linear(x, nw, 1e-5, w)


MATMUL_OPS = ("linear", "norm_linear", "norm_linear_silu")


def _backend(gemv: bool = True):
    """A Triton backend with the GEMV pinned for every matmul (gemv), or cuBLAS for all of them."""
    from engine.backend import RoutedBackend
    from engine.kernels.routes import Pin, RouteTable
    return RoutedBackend(routes=RouteTable.pinned(*[Pin("gemv", op=op) for op in MATMUL_OPS if gemv]))


def _counting(monkeypatch, record=lambda name, a: name):
    calls = []
    for name in ("decode_norm_linear_silu", "decode_linear", "decode_norm_linear", "decode_silu_linear"):
        real = getattr(dg, name)
        monkeypatch.setattr(dg, name, lambda *a, _real=real, _name=name, **kw: calls.append(record(_name, a))
                            or _real(*a, **kw))
    return calls


def test_backend_takes_the_gemv_where_pinned_and_falls_back_otherwise(monkeypatch):
    """RoutedBackend's linears with the GEMV pinned: a few rows without bias go to it (silu_linear as silu_mul,
    then the GEMV), with the results of cuBLAS; more rows than it takes, a bias or no pin go to cuBLAS."""
    calls = _counting(monkeypatch)
    on, off = _backend(), _backend(gemv=False)
    x, w = randn(2, 64, seed=20, dtype=torch.float32), randn(24, 64, seed=21, dtype=torch.float32)
    nw, res = randn(64, seed=22, dtype=torch.float32), randn(2, 64, seed=23, dtype=torch.float32)
    gu, wd = randn(2, 128, seed=24, dtype=torch.float32), randn(24, 64, seed=25, dtype=torch.float32)
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(on.linear(x, w), off.linear(x, w), **close)
    for a, b in zip(on.norm_linear(x, res, nw, 1e-5, w), off.norm_linear(x, res, nw, 1e-5, w)):
        torch.testing.assert_close(a, b, **close)
    torch.testing.assert_close(on.silu_linear(gu, wd), off.silu_linear(gu, wd), **close)
    assert calls == ["decode_linear", "decode_norm_linear", "decode_linear"]
    calls.clear()
    on.linear(randn(dg.MAX_ROWS + 1, 64, seed=26, dtype=torch.float32), w)               # too many rows
    on.linear(x, w, bias=randn(24, seed=27, dtype=torch.float32))                         # a bias
    off.linear(x, w)
    assert calls == []


def test_rows_past_max_k_without_a_prologue(monkeypatch):
    """decode_linear takes rows up to MAX_K_PLAIN (8 warps a row); the prologues stop at MAX_K. The backend with
    the GEMV pinned sends such a linear to it (Llama 8B's down projection, K = 14336) and a norm_linear of that K,
    or more rows than the GEMV takes, to cuBLAS."""
    k = dg.MAX_K + 808
    x, w = randn(2, k, seed=30, dtype=torch.float32), randn(6, k, seed=31, dtype=torch.float32) / k ** 0.5
    nw = randn(k, seed=32, dtype=torch.float32)
    want = F.linear(x, w)
    torch.testing.assert_close(dg.decode_linear(x, w), want, rtol=1e-5, atol=1e-5)
    assert dg.decode_gemv_config(6, k)["num_warps"] == 8
    with pytest.raises(ValueError, match="K at most"):
        dg.decode_norm_linear(x, nw, 1e-5, w)
    with pytest.raises(ValueError, match="K at most"):
        dg.decode_linear(randn(1, dg.MAX_K_PLAIN + 1, seed=33, dtype=torch.float32),
                         randn(2, dg.MAX_K_PLAIN + 1, seed=34, dtype=torch.float32))
    calls = _counting(monkeypatch, lambda name, a: (name, a[0].shape[0]))
    backend = _backend()
    torch.testing.assert_close(backend.linear(x, w), want, rtol=1e-5, atol=1e-5)
    backend.linear(randn(dg.MAX_ROWS + 1, k, seed=35, dtype=torch.float32), w)     # past the GEMV's rows: cuBLAS
    backend.norm_linear(x, None, nw, 1e-5, w)                                         # a prologue past MAX_K: cuBLAS
    assert calls == [("decode_linear", 2)]


def test_long_k_takes_one_row_at_a_time():
    """A K past AT_ONCE_MAX_K (Llama 8B's 4096) runs its rows one at a time, a shorter one at 2-4 rows all at
    once; either way F.linear's results."""
    k = 2 * dg.AT_ONCE_MAX_K
    assert dg.one_row_at_a_time(k) and not dg.one_row_at_a_time(dg.AT_ONCE_MAX_K) and not dg.one_row_at_a_time(1536)
    assert dg.decode_gemv_config(8, k, 4)["ROWS"] == 0 and dg.decode_gemv_config(8, 1536, 4)["ROWS"] == 4
    w = randn(8, k, seed=40, dtype=torch.float32) / k ** 0.5
    for rows in (1, 4):
        x = randn(rows, k, seed=41 + rows, dtype=torch.float32)
        torch.testing.assert_close(dg.decode_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("add_residual", [False, True])
def test_backend_mlp_takes_the_silu_epilogue_where_the_gemv_takes_gate_up(monkeypatch, add_residual):
    """norm_mlp with the GEMV pinned: gate_up's GEMV stores SiLU * up and the down projection reads it (the
    residual added in the GEMV's epilogue); the outputs are cuBLAS's (silu_mul's kernel between). For more rows
    than the GEMV takes, cuBLAS runs."""
    calls = _counting(monkeypatch)
    on, off = _backend(), _backend(gemv=False)
    args = lambda m: (randn(m, 64, seed=40, dtype=torch.float32), randn(m, 64, seed=41, dtype=torch.float32),
                      randn(64, seed=42, dtype=torch.float32), 1e-5, randn(48, 64, seed=43, dtype=torch.float32),
                      randn(64, 24, seed=44, dtype=torch.float32))
    got = on.norm_mlp(*args(2), add_residual=add_residual)
    assert calls == ["decode_norm_linear_silu", "decode_linear"]
    calls.clear()
    want = off.norm_mlp(*args(2), add_residual=add_residual)
    assert calls == []
    for a, b in zip(got, want):     # another SiLU formula and summation order: fp32 roundings apart
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    on.norm_mlp(*args(dg.MAX_ROWS + 1))
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [2, 3, 4, 8])
@pytest.mark.parametrize("op", ["norm", "silu", "none", "add", "argmax", "silu_mul"])
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
    elif op == "silu_mul":
        kw = dict(nw=randn(k, seed=23, dtype=dtype), eps=1e-5, epilogue="silu_mul")
    prologue = {"norm": "norm", "silu": "silu", "silu_mul": "norm"}.get(op, "none")
    assert dg.decode_gemv_config(n, k, m)["ROWS"] == (triton.next_power_of_2(m) if m <= 4 else 0)
    loop = dg.launch(x, w, k, prologue, at_once=False, **kw)
    once = dg.launch(x, w, k, prologue, at_once=True, **kw)
    for a, b in zip(loop, once):
        if DEV == "cpu" or a.dtype not in TOL:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=TOL[a.dtype][0], atol=TOL[a.dtype][1] * a.abs().max().item())
