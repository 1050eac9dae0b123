"""engine.kernels.matmul.decode_gemm (5 to 32 rows on tensor cores, weights read before the dependent-launch wait)
against the torch ops it replaces, the backend running it where the route table pins it, and engines with it pinned
against cuBLAS. Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leak, triton_module

dg = triton_module("matmul.decode_gemv")
gm = triton_module("matmul.decode_gemm")
DEV = "cpu" if gm.interpreted() else "cuda"
EPS = 1e-5
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (M, K, N): K = 64 (one piece), 96 (64 + 32), 192 (128 + 64); N never a multiple of BLOCK_N
SHAPES = pytest.mark.parametrize("m,k,n", [(5, 64, 40), (8, 96, 100), (17, 192, 33), (32, 96, 70)])
# fp32: summation order only; bf16: one output rounding apart
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 * 2 ** -7, 2 * 2 ** -8)}


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def randint(*shape, seed, high=16, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(-high, high + 1, shape, generator=g, device=DEV).to(dtype)


def close(got, want):
    rtol, atol = TOL[want.dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=2 * rtol, atol=2 * atol * want.float().abs().max().item())


@DTYPES
@SHAPES
def test_entry_points_match_the_separate_ops(m, k, n, dtype):
    from engine.kernels.fused_ops import rms_norm_ref, silu_mul_ref
    x = (randn(m, k + 5, seed=1, dtype=dtype) * 3)[:, 2:2 + k]          # strided rows, unit stride in K
    res, nw = randn(m, k, seed=2, dtype=dtype), randn(k, seed=3, dtype=dtype)
    w = randn(n, k, seed=4, dtype=dtype) / k ** 0.5
    close(gm.decode_linear(x, w), F.linear(x.float(), w.float()).to(dtype))
    got, h = gm.decode_norm_linear(x, nw, EPS, w, res)
    normed, want_h = rms_norm_ref(x, nw, EPS, res)
    assert torch.equal(h, want_h)                                         # the new residual: bit for bit
    close(got, F.linear(normed.float(), w.float()).to(dtype))
    got, h = gm.decode_norm_linear(x, nw, EPS, w)
    assert h is x
    close(got, F.linear(rms_norm_ref(x, nw, EPS).float(), w.float()).to(dtype))
    gu, r = randn(m, 2 * k, seed=5, dtype=dtype) * 2, randn(m, n, seed=6, dtype=dtype)
    out = gm.decode_silu_linear(gu, w)
    close(out, F.linear(silu_mul_ref(gu).float(), w.float()).to(dtype))
    assert torch.equal(gm.decode_silu_linear(gu, w, residual=r), r + out)   # the residual epilogue: torch's add


@DTYPES
@pytest.mark.parametrize("m,residual", [(5, False), (17, True), (32, True)])
def test_silu_epilogue_matches_norm_linear_then_silu_mul(m, residual, dtype):
    """gate_up with SiLU * up in the epilogue gives silu_mul of decode_norm_linear's own gate_up (each program pairs
    gate rows with the up rows of the same columns; the last program ragged) and its residual, in a decode step's
    launch as well."""
    from engine.kernels.fused_ops import silu_mul_ref
    k, inter = 96, 37
    x, nw = randn(m, k, seed=31, dtype=dtype) * 2, randn(k, seed=33, dtype=dtype)
    res = randn(m, k, seed=32, dtype=dtype) if residual else None
    w = randn(2 * inter, k, seed=34, dtype=dtype) / k ** 0.5
    act, new_res = gm.decode_norm_linear_silu(x, nw, EPS, w, res)
    gate_up, want_res = gm.decode_norm_linear(x, nw, EPS, w, res)
    assert act.shape == (m, inter) and act.dtype == dtype
    assert torch.equal(new_res, want_res)
    # the kernel's SiLU is g / (1 + exp(-g)), torch's another formula: one rounding apart at most
    torch.testing.assert_close(act, silu_mul_ref(gate_up), rtol=TOL[dtype][0], atol=1e-6)
    assert torch.equal(gm.decode_norm_linear_silu(x, nw, EPS, w, res, decode=True)[0], act)
    with pytest.raises(ValueError, match="even N"):
        gm.decode_norm_linear_silu(x, nw, EPS, w[:-1], res)


MATMUL_OPS = ("linear", "norm_linear", "norm_linear_silu")


def _backend(*routes):
    """A Triton backend running `routes` ((kernel, rows lo, rows hi) for every matmul op), cuBLAS elsewhere."""
    from engine.backend import RoutedBackend
    from engine.kernels.routes import Pin, RouteTable
    return RoutedBackend(routes=RouteTable.pinned(*[Pin(kernel, op=op, rows=(lo, hi)) for kernel, lo, hi in routes
                                                      for op in MATMUL_OPS]))


def _counting(monkeypatch, modules, record=lambda module, name, a, kw: name):
    """Each call of the modules' matmul entry points, as record(module, name, args, keywords)."""
    calls = []
    for module in modules:
        for name in ("decode_norm_linear_silu", "decode_linear", "decode_norm_linear", "decode_silu_linear"):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _r=real, _m=module, _n=name, **kw:
                                calls.append(record(_m, _n, a, kw)) or _r(*a, **kw))
    return calls


@pytest.mark.parametrize("add_residual", [False, True])
def test_backend_mlp_takes_decode_gemms_silu_epilogue(monkeypatch, add_residual):
    """norm_mlp of 9 rows on decode_gemm: gate_up stores SiLU * up in its epilogue and the down projection reads
    it (the residual added after); the outputs are cuBLAS's."""
    calls = _counting(monkeypatch, [gm])
    b, ref = _backend(("gemm", 1, 32)), _backend()
    args = (randn(9, 64, seed=40), randn(9, 64, seed=41), randn(64, seed=42), EPS, randn(48, 64, seed=43) / 8,
            randn(64, 24, seed=44) / 5)
    got = b.norm_mlp(*args, add_residual=add_residual)
    assert calls == ["decode_norm_linear_silu", "decode_linear"]
    for a, c in zip(got, ref.norm_mlp(*args, add_residual=add_residual)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


@DTYPES
@pytest.mark.parametrize("m,k", [(5, 64), (17, 192), (32, 96)])
def test_exact_where_the_products_are(m, k, dtype):
    """Integer operands: every fp32 sum is exact in any order, so the outputs are torch's bit for bit. The norm:
    rows of one magnitude 2^j (signs random) and eps = 0 make 1 / rms = 2^-j exact, A = +-norm_weight."""
    from engine.kernels.fused_ops import rms_norm_ref
    n = 70
    x, w = randint(m, k, seed=7, dtype=dtype), randint(n, k, seed=8, dtype=dtype)
    assert torch.equal(gm.decode_linear(x, w), F.linear(x, w))
    signs = torch.where(randn(m, k, seed=9) > 0, 1.0, -1.0)
    mag = 2.0 ** torch.arange(m, device=DEV).remainder(5)[:, None]
    x, nw = (signs * mag).to(dtype), randint(k, seed=10, dtype=dtype)
    want = F.linear(rms_norm_ref(x, nw, 0.0), w)
    assert torch.equal(gm.decode_norm_linear(x, nw, 0.0, w)[0], want)
    got, h = gm.decode_norm_linear(x, nw, 0.0, w, residual=x)             # h = 2x
    assert torch.equal(got, want) and torch.equal(h, 2 * x)


@DTYPES
def test_argmax_epilogue(dtype):
    """Each program's largest logit of a row and its first vocabulary row: their first maximum is the argmax."""
    from engine.kernels.fused_ops import rms_norm_ref
    m, k, v = 9, 96, 300
    x, nw, w = randn(m, k, seed=11, dtype=dtype) * 3, randn(k, seed=12, dtype=dtype), randn(v, k, seed=13, dtype=dtype)
    val, _, idx = gm.launch(x, w, k, "norm", nw=nw, eps=EPS, epilogue="argmax")
    block_n = gm.decode_gemm_config(m, v, k)["BLOCK_N"]
    assert val.shape == idx.shape == (m, (v + block_n - 1) // block_n)
    got = idx.gather(1, val.argmax(1, keepdim=True))[:, 0].long()
    assert torch.equal(got, F.linear(rms_norm_ref(x, nw, EPS), w).float().argmax(-1))


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=8, BLOCK_N=8, BLOCK_K=16, num_warps=4, num_stages=1),
                                 dict(BLOCK_M=8, GROUPS=2, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1),
                                 dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=1)],
                         ids=["small", "two-groups-a-program", "large"])
def test_any_config_gives_the_same_bits(cfg, monkeypatch):
    """What a bench's sweep may pass: other groups, groups a program (all of them without GROUPS), tiles and
    chunks (K = 96: 64 + 32) give the exact integer results."""
    monkeypatch.setattr(gm, "decode_gemm_config", lambda m, n, k, decode=False: dict(cfg))
    x, w, nw = randint(17, 96, seed=14), randint(70, 96, seed=15), torch.ones(96, device=DEV)
    assert torch.equal(gm.decode_linear(x, w), F.linear(x, w))
    gu = torch.cat([torch.full((17, 96), 30.0, device=DEV), x], 1)       # silu(30) = 30 in fp32
    assert torch.equal(gm.decode_silu_linear(gu, w), F.linear(30 * x, w))
    x = torch.where(randn(17, 96, seed=16) > 0, 4.0, -4.0)
    assert torch.equal(gm.decode_norm_linear(x, nw, 0.0, w)[0], F.linear(x / 4, w))
    h = torch.where(randn(17, 96, seed=17) > 0, 1.0, -1.0)            # x + residual: every row's new residual
    out, new_res = gm.decode_norm_linear(x - h, nw, 0.0, w, residual=h)
    assert torch.equal(new_res, x) and torch.equal(out, F.linear(x / 4, w))


def test_pieces_and_default_configs():
    assert [gm.pieces(k) for k in (576, 1536, 2048, 192, 100, 10)] == [(512, 64), (1024, 512), (2048, 0), (128, 64),
                                                                       (64, 64), (16, 0)]
    picks = {}
    for n, k in [(960, 576), (3072, 576), (576, 1536), (576, 576), (2048, 2048)]:
        for m in (5, 16, 32):
            cfg = gm.decode_gemm_config(m, n, k)
            bn = picks[n, k, m] = cfg["BLOCK_N"]
            assert cfg["BLOCK_M"] == 8 and cfg["num_warps"] == 4 and bn * sum(gm.pieces(k)) <= gm._TILE
            assert bn == 16 or -(-n // bn) * -(-m // 8) >= gm._PROGRAMS      # a wider tile leaves enough programs
    assert picks[3072, 576, 32] == 64 and picks[960, 576, 32] == 32 and picks[576, 576, 32] == 16
    # a decode step's rule: o_proj and down at 25-32 rows take 32 weight rows a program; nothing else moves
    decode = {(n, k, m): gm.decode_gemm_config(m, n, k, decode=True)["BLOCK_N"] for n, k, m in picks}
    assert decode[576, 576, 32] == decode[576, 1536, 32] == 32
    assert {key: bn for key, bn in decode.items() if key[0] != 576 or key[2] != 32} == \
        {key: bn for key, bn in picks.items() if key[0] != 576 or key[2] != 32}
    assert gm.decode_gemm_config(25, 576, 576, decode=True)["BLOCK_N"] == 32
    assert gm.decode_gemm_config(24, 576, 576, decode=True)["BLOCK_N"] == 16


def test_refusals():
    x, w = randn(8, 64, seed=1), randn(40, 64, seed=2)
    assert gm.supports(x, w) and gm.supports(randn(gm.MAX_ROWS, 64, seed=3), w)
    for rows in (gm.MIN_ROWS - 1, gm.MAX_ROWS + 1):
        assert not gm.supports(randn(rows, 64, seed=3), w)
        with pytest.raises(ValueError, match="rows"):
            gm.decode_linear(randn(rows, 64, seed=3), w)
    bad = [(lambda: gm.decode_linear(x, randn(40, 63, seed=4)), "does not fit"),
           (lambda: gm.decode_linear(randn(8, gm.MAX_K + 64, seed=4), randn(4, gm.MAX_K + 64, seed=4)), "K at most"),
           (lambda: gm.decode_linear(x, randn(64, 40, seed=5).t()), "stride"),
           (lambda: gm.decode_linear(x, randn(40, 70, seed=5)[:, :64]), "contiguous"),
           (lambda: gm.decode_linear(x[0], w), "2-D"),
           (lambda: gm.decode_norm_linear(x, randn(65, seed=6), EPS, w), "norm_weight"),
           (lambda: gm.decode_norm_linear(x, randn(64, seed=6), EPS, w, randn(8, 65, seed=7)), "residual"),
           (lambda: gm.decode_silu_linear(randn(8, 127, seed=8), w), "gate_up"),
           (lambda: gm.decode_silu_linear(randn(8, 128, seed=8), w, randn(8, 41, seed=9)), "residual")]
    for call, match in bad:
        with pytest.raises(ValueError, match=match):
            call()


def test_backend_runs_the_pinned_kernel_where_it_takes_the_call(monkeypatch):
    """The GEMV pinned to 4 rows, decode_gemm from 5 to 16 and from 33 (past its MAX_ROWS): linear, norm_linear
    and silu_linear (silu_mul, then linear) run the pinned kernel; unpinned rows, rows the kernel cannot take and a
    bias take cuBLAS. The results are cuBLAS's."""
    calls = _counting(monkeypatch, (dg, gm), lambda module, name, a, kw: module)
    w, wd, nw = randn(24, 64, seed=20), randn(24, 64, seed=21), randn(64, seed=22)
    on, off = _backend(("gemv", 1, 4), ("gemm", 5, 16), ("gemm", 33, 64)), _backend()
    for m, want in [(2, dg), (5, gm), (16, gm), (17, None), (33, None)]:
        x, res, gu = randn(m, 64, seed=23), randn(m, 64, seed=24), randn(m, 128, seed=25)
        torch.testing.assert_close(on.linear(x, w), off.linear(x, w), rtol=1e-5, atol=1e-5)
        for a, b in zip(on.norm_linear(x, res, nw, EPS, w), off.norm_linear(x, res, nw, EPS, w)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(on.silu_linear(gu, wd), off.silu_linear(gu, wd), rtol=1e-5, atol=1e-5)
        assert calls == ([want] * 3 if want else []), m
        calls.clear()
    on.linear(randn(8, 64, seed=26), w, bias=randn(24, seed=27))
    assert calls == []


def _meta(rows: int, query_len: int):
    """A step's metadata: rows // query_len sequences of query_len new tokens each."""
    from engine.attention import AttentionMetadata
    seqs = rows // query_len
    return AttentionMetadata(slot_mapping=torch.arange(rows), cu_seqlens_q=torch.arange(0, rows + 1, query_len,
                             dtype=torch.int32), seq_lens=torch.full((seqs,), 16, dtype=torch.int32),
                             block_tables=torch.zeros(seqs, 1, dtype=torch.int32), max_query_len=query_len,
                             max_seq_len=16)


def test_backend_tells_decode_gemm_a_decode_step(monkeypatch):
    """decode_gemm's launch rule by step kind: the backend passes decode=True only for a decode step's metadata (one
    token a sequence) and only to decode_gemm; a verification of the same rows, no metadata and the GEMV get none."""
    calls = _counting(monkeypatch, (dg, gm), lambda module, name, a, kw: (module, kw))
    b = _backend(("gemv", 1, 4), ("gemm", 5, 16))
    w, wd, nw = randn(24, 64, seed=30), randn(24, 64, seed=31), randn(64, seed=32)
    for rows, meta, want in [(8, _meta(8, 1), {"decode": True}), (8, _meta(8, 4), {}), (8, None, {}),
                             (4, _meta(4, 1), {})]:
        x, res, gu = randn(rows, 64, seed=33), randn(rows, 64, seed=34), randn(rows, 128, seed=35)
        b.linear(x, w, meta=meta)
        b.norm_linear(x, res, nw, EPS, w, meta=meta)
        b.silu_linear(gu, wd, meta=meta)
        b.norm_mlp(x, res, nw, EPS, randn(48, 64, seed=36), randn(64, 24, seed=37), meta=meta)
        assert len(calls) == 5 and all(kw == want for _, kw in calls), (rows, meta and meta.max_query_len, calls)
        assert {m for m, _ in calls} == {gm if rows > 4 else dg}
        calls.clear()


def test_the_dependent_launch_limit():
    code = ("from engine.kernels import common; from engine.kernels.matmul import decode_gemv; "
            "print(common.PDL_MAX_ROWS, decode_gemv.MAX_ROWS)")
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_PDL_MAX_ROWS"}
    for limit, want in ((None, "32"), ("16", "16")):
        out = subprocess.run([sys.executable, "-c", code], env=env | ({"SPECDEC_PDL_MAX_ROWS": limit} if limit else {}),
                             capture_output=True, text=True, check=True)
        assert out.stdout.split() == [want, "8"]      # decode_gemm's MAX_ROWS; the GEMV's limit stays


def test_engine_outputs_equal_with_decode_gemm(monkeypatch):
    """A whole engine (Triton backend, a 2-layer dummy model): decode_gemm pinned from 5 to 32 rows (the GEMV to
    4) gives the greedy tokens of cuBLAS everywhere (kernels="reference", where neither kernel runs), its prefill
    and decode steps of 6 rows taking the kernel, the decode steps by their own launch rule; so do the GEMV to 8
    rows, and decode_gemm from 2 to 4 rows (a verification of 1 + K tokens from one stream) with the GEMV at 1."""
    from engine.kernels.routes import pins
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    calls, kinds = {gm: [], dg: []}, []
    monkeypatch.setattr(gm, "launch", lambda *a, _r=gm.launch, **kw: kinds.append((a[0].shape[0], kw.get("decode")))
                        or _r(*a, **kw))
    for mod in calls:
        for name in ("decode_linear", "decode_norm_linear", "decode_norm_linear_silu"):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _r=real, _c=calls[mod], **kw: _c.append(a[0].shape[0])
                                or _r(*a, **kw))
    prompts = [[5, 17, 99, 3], [300, 1, 2], [7, 7, 7, 7, 8], [42], [11, 400, 13], [256, 255]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 4, 5, 6, 7)]
    gemm = lambda rows: [dict(kernel="gemm", op=op, rows=rows) for op in MATMUL_OPS]
    cublas = dict(kernel="cublas")      # under the pins: on a GPU the tuner's routes would take the other rows
    routes = {"reference": dict(kernels="reference"),
              "gemm": dict(kernel_routes=pins(cublas, dict(kernel="gemv", rows=[1, 4]), *gemm([5, 32]))),
              "gemv": dict(kernel_routes=pins(cublas, dict(kernel="gemv", rows=[1, 8]))),
              "short_gemm": dict(kernel_routes=pins(cublas, dict(kernel="gemv", rows=1), *gemm([2, 4])))}
    runs, seen = {}, {}
    for name, kw in routes.items():
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton", depth=1,
                        max_num_seqs=8, max_model_len=64, enforce_eager=True, **kw)
        for c in (*calls.values(), kinds):      # not the route tuner's calls at start (on a GPU)
            c.clear()
        runs[name] = [s.output_token_ids for s in eng.generate(prompts, params)]
        assert_no_leak(eng)
        seen[name] = set(calls[gm]), set(calls[dg])
        if name == "gemm":      # decode steps (6 rows or fewer) launch by the decode rule; prefill steps do not
            assert {d for n, d in kinds if n > 6} == {False} and (6, True) in kinds, kinds
    assert all(run == runs["reference"] for run in runs.values())
    assert seen["reference"] == (set(), set())
    assert not seen["gemv"][0] and 6 in seen["gemv"][1] and seen["gemv"][1] <= set(range(1, 9))
    assert 6 in seen["gemm"][0] and seen["gemm"][0] <= set(range(5, 33)) and seen["gemm"][1] <= {1, 2, 3, 4}
    assert seen["short_gemm"][0] == {2, 3, 4} and seen["short_gemm"][1] == {1}
