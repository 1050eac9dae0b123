"""engine.kernels.matmul.stream_gemm (2-64 rows over a large weight, streamed over K on tensor cores) against
F.linear, its refusals, the backend running it where the route table pins it, and an engine with it pinned against
cuBLAS. Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch
import torch.nn.functional as F

from conftest import triton_module
from engine.kernels.routes import Pin, RouteTable, pins

sg = triton_module("matmul.stream_gemm")
DEV = "cpu" if sg.interpreted() else "cuda"
# fp32: summation order only; bf16 (CUDA): one output rounding apart
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 * 2 ** -7, 2 * 2 ** -8)}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * 0.5).to(dtype)


# rows across every BLOCK_M (16, 32, 64); N not a multiple of BLOCK_N; K not a multiple of BLOCK_K
@pytest.mark.parametrize("m,n,k", [(2, 40, 64), (3, 100, 300), (16, 33, 256), (17, 70, 96), (33, 20, 512),
                                   (64, 48, 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_linear_matches_torch(m, n, k, dtype):
    x, w = randn(m, k, seed=1, dtype=dtype), randn(n, k, seed=2, dtype=dtype)
    got = sg.linear(x, w)
    want = F.linear(x.float(), w.float()).to(dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=TOL[dtype][0], atol=TOL[dtype][1])


# the norm over K not a multiple of BLOCK_K, rows across BLOCK_M; gate_up's pairs across programs
@pytest.mark.parametrize("m,n,k", [(2, 40, 64), (5, 96, 300), (17, 64, 96), (33, 20, 512)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_norm_and_silu_folded_in_match_the_separate_ops(m, n, k, with_residual, dtype):
    from engine.kernels import fused_ops
    x, w = randn(m, k, seed=11, dtype=dtype) * 3, randn(n, k, seed=12, dtype=dtype)
    nw = (torch.rand(k, device=DEV) + 0.5).to(dtype)
    residual = randn(m, k, seed=13, dtype=dtype) if with_residual else None
    ref = (fused_ops.rms_norm(x, nw, 1e-5, residual) if with_residual
           else (fused_ops.rms_norm(x, nw, 1e-5), x))
    want = F.linear(ref[0].float(), w.float()).to(dtype)
    out, new_res = sg.norm_linear(x, nw, 1e-5, w, residual)
    big = float(want.float().abs().max())          # the norm's rounding differs: errors scale with the output
    torch.testing.assert_close(out, want, rtol=TOL[dtype][0], atol=TOL[dtype][1] * max(1.0, big))
    assert (new_res is x) if residual is None else torch.equal(new_res, ref[1])
    act, new_res = sg.norm_linear_silu(x, nw, 1e-5, w, residual)
    gate, up = want.float().chunk(2, dim=1)
    scale = big ** 2                                # act's error: |up| |d gate| + |gate| |d up|
    torch.testing.assert_close(act, (F.silu(gate) * up).to(dtype), rtol=2 * TOL[dtype][0],
                               atol=2 * TOL[dtype][0] * scale)
    assert act.shape == (m, n // 2)
    assert (new_res is x) if residual is None else torch.equal(new_res, ref[1])


@pytest.mark.parametrize("m,n,k,elem,x_tiles", [(8, 3072, 2048, 2, 2), (32, 28672, 4096, 2, 2),
                                                 (33, 20, 512, 4, 2), (64, 4096, 8192, 4, 2), (2, 576, 576, 2, 1),
                                                 (40, 2048, 2048, 2, 1)])
@pytest.mark.parametrize("variant", ["base", "wide", "narrow", "split"])
def test_the_launch_config_fits_its_shared_memory(m, n, k, elem, x_tiles, variant):
    """The pipeline's buffers fit what a program may take, by fewer stages first, then shorter K tiles (a float32
    step of 33 rows with a residual once asked an H100 for 247 KB)."""
    smem = 227 * 1024 - sg.SMEM_SPARE
    cfg = sg.config(m, n, k, elem, x_tiles, smem, variant)
    bm, bn, bk, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["NUM_STAGES"]
    assert elem * bk * (stages * (bn + x_tiles * bm) + bm) + 4 * bn * bm <= smem
    assert bm >= m and 2 <= stages <= 4 and bk >= sg.MIN_K
    assert sg.config(m, n, k, elem, x_tiles, variant=variant)["NUM_STAGES"] == 4       # no limit: four stages


def test_the_variants_change_the_programs_weight_rows_and_warps():
    base, wide, narrow = (sg.config(8, 16384, 2048, variant=v) for v in ("base", "wide", "narrow"))
    assert (base["BLOCK_N"], base["num_warps"]) == (64, 4)
    assert (wide["BLOCK_N"], wide["BLOCK_K"], wide["num_warps"]) == (128, 128, 8)
    assert (narrow["BLOCK_N"], narrow["BLOCK_K"], narrow["num_warps"]) == (16, 256, 4)
    with pytest.raises(ValueError, match="unknown stream_gemm variant 'tall'"):
        sg.config(8, 16384, 2048, variant="tall")


# each variant's launch over N and K that are not multiples of its tiles, with the norm, residual and SiLU
@pytest.mark.parametrize("variant", ["wide", "narrow"])
@pytest.mark.parametrize("m,n,k", [(3, 200, 300), (17, 36, 96)])
def test_each_variant_matches_the_base_launch(variant, m, n, k):
    x, w = randn(m, k, seed=21) * 3, randn(n, k, seed=22)
    nw, residual = torch.rand(k, device=DEV) + 0.5, randn(m, k, seed=23)
    torch.testing.assert_close(sg.linear(x, w, variant), sg.linear(x, w), rtol=1e-5, atol=1e-5)
    for fn in (sg.norm_linear, sg.norm_linear_silu):
        for got, want in zip(fn(x, nw, 1e-5, w, residual, variant), fn(x, nw, 1e-5, w, residual)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_the_split_launch_fits_the_sms_in_one_wave_with_splits_of_at_least_two_k_tiles():
    down = sg.config(8, 2048, 8192, variant="split", sms=132)       # 32 tiles of 64 rows: 4 splits, one wave
    assert (down["BLOCK_N"], down["SPLITS"], down["K_SPLIT"]) == (64, 4, 2048)
    qkv = sg.config(8, 3072, 2048, variant="split", sms=132)        # 48 tiles: 2 splits, not 3 in two waves
    assert (qkv["SPLITS"], qkv["K_SPLIT"]) == (2, 1024)
    odd = sg.config(8, 2048, 7000, variant="split", sms=132)        # the last split shorter
    assert (odd["SPLITS"], odd["K_SPLIT"]) == (4, 1792)
    o_proj = sg.config(8, 2048, 2048, variant="split", sms=132)     # K leaves room for 4 splits of 2 tiles
    assert (o_proj["SPLITS"], o_proj["K_SPLIT"]) == (4, 512)
    assert sg.config(8, 28672, 4096, variant="split", sms=132)["SPLITS"] == 1    # 448 tiles fill the SMs
    for cfg, n, k in ((down, 2048, 8192), (o_proj, 2048, 2048), (qkv, 3072, 2048), (odd, 2048, 7000)):
        assert -(-n // cfg["BLOCK_N"]) * cfg["SPLITS"] <= 132
        assert (cfg["SPLITS"] - 1) * cfg["K_SPLIT"] < k <= cfg["SPLITS"] * cfg["K_SPLIT"]
        assert cfg["K_SPLIT"] % cfg["BLOCK_K"] == 0 and cfg["K_SPLIT"] >= 2 * cfg["BLOCK_K"]


def _counters(n=64):
    return torch.zeros(n, dtype=torch.int32, device=DEV)


# K not a multiple of the split or the tile; the last split shorter; rows across BLOCK_M
@pytest.mark.parametrize("m,n,k", [(3, 40, 1100), (17, 64, 1536), (2, 24, 2048)])
def test_the_split_launch_matches_the_base_launch_and_leaves_its_counters_zero(m, n, k):
    x, w = randn(m, k, seed=31) * 3, randn(n, k, seed=32)
    nw, residual = torch.rand(k, device=DEV) + 0.5, randn(m, k, seed=33)
    counters = _counters()
    cfg = sg.config(m, n, k, variant="split")
    assert cfg["SPLITS"] >= 2
    for _ in range(2):          # the second launch finds the counters as the first left them
        for got, want in [(sg.linear(x, w, "split", counters), sg.linear(x, w)), *[
                pair for fn in (sg.norm_linear, sg.norm_linear_silu)
                for pair in zip(fn(x, nw, 1e-5, w, residual, "split", counters), fn(x, nw, 1e-5, w, residual))]]:
            # fp32 sums in another order: a few units of rounding of the largest value
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert not counters.any()


def test_the_split_launch_needs_room_for_two_splits_and_a_counter_a_tile():
    x, w = randn(4, 1024, seed=34), randn(96, 1024, seed=35)
    assert sg.supports(x, w, variant="split", counters=_counters())
    for counters, words in ((None, "counter buffer"), (_counters().long(), "counter buffer"),
                            (torch.zeros(64, 2, dtype=torch.int32, device=DEV)[:, 0], "unit stride"),
                            (_counters(3), "needs 6 counters, the buffer holds 3")):
        assert not sg.supports(x, w, variant="split", counters=counters)
        with pytest.raises(ValueError, match=words):
            sg.linear(x, w, "split", counters)
    with pytest.raises(ValueError, match="no room for two splits"):
        sg.linear(x[:, :256].contiguous(), w[:, :256].contiguous(), "split", _counters())


def test_an_odd_gate_up_or_a_wrong_norm_weight_is_refused():
    x, nw = randn(4, 64, seed=14), torch.ones(64, device=DEV)
    with pytest.raises(ValueError, match="even N"):
        sg.norm_linear_silu(x, nw, 1e-5, randn(9, 64, seed=15))
    with pytest.raises(ValueError, match="norm_weight"):
        sg.norm_linear(x, torch.ones(32, device=DEV), 1e-5, randn(8, 64, seed=15))
    with pytest.raises(ValueError, match="norm_weight .* unit stride"):
        sg.norm_linear(x, torch.ones(64, 2, device=DEV)[:, 0], 1e-5, randn(8, 64, seed=15))


def test_rows_of_a_strided_x_are_read_where_they_are():
    wide = randn(5, 128, seed=3)
    x, w = wide[:, :64], randn(24, 64, seed=4)             # rows 128 apart, each contiguous
    torch.testing.assert_close(sg.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x,w,words", [
    (torch.zeros(1, 64), torch.zeros(8, 64), "1 rows"),
    (torch.zeros(65, 64), torch.zeros(8, 64), "65 rows"),
    (torch.zeros(4, 64), torch.zeros(8, 32), "K must match"),
    (torch.zeros(4, 8), torch.zeros(8, 8), "at least 16"),
    (torch.zeros(4, 64), torch.zeros(8, 64, dtype=torch.float64), "share a float dtype"),
    (torch.zeros(64, 4).t(), torch.zeros(8, 64), "contiguous"),
])
def test_what_it_cannot_take_is_refused_naming_why(x, w, words):
    x, w = x.to(DEV), w.to(DEV)
    assert not sg.supports(x, w)
    with pytest.raises(ValueError, match=words):
        sg.linear(x, w)


@pytest.mark.parametrize("op,kernel", [("linear", "stream"), ("linear", "stream_narrow"), ("norm_linear", "stream"),
                                       ("norm_linear", "stream_wide"), ("norm_linear_silu", "stream"),
                                       ("norm_linear_silu", "stream_wide"), ("linear", "stream_split"),
                                       ("norm_linear", "stream_split"), ("norm_linear_silu", "stream_split")])
def test_the_backend_runs_each_matmul_op_on_it_where_pinned(op, kernel, monkeypatch):
    from engine.backend import RoutedBackend
    from engine.kernels.routes import STREAM_KERNELS
    launched, config = [], sg.config
    monkeypatch.setattr(sg, "config", lambda *a, **kw: launched.append(kw["variant"]) or config(*a, **kw))
    n, k, rows = 96, 64 if kernel != "stream_split" else 1024, 5
    w, x = randn(n, k, seed=5), randn(rows, k, seed=6)
    nw, residual = torch.rand(k, device=DEV) + 0.5, randn(rows, k, seed=7)
    add = randn(rows, n, seed=8)
    routed = RoutedBackend(routes=RouteTable.pinned(Pin(kernel, op=op)), device=DEV)
    reference = RoutedBackend(routes=RouteTable.pinned(Pin("cublas")), device=DEV)
    assert routed.kernel_for(op, x, w, norm_weight=nw, residual=residual) == kernel
    assert routed.kernel_for(op, x[:1], w, norm_weight=nw, residual=residual[:1]) == "cublas"   # one row: not its

    def run(backend):
        if op == "linear":
            return (backend.linear(x, w, add=add),)
        fn = backend.norm_linear if op == "norm_linear" else backend.norm_linear_silu
        return fn(x, residual, nw, 1e-5, w)
    tol = 1e-5 if k == 64 else 2e-4          # fp32 summation order over K
    for got, want in zip(run(routed), run(reference)):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert set(launched) == {STREAM_KERNELS[kernel]}           # the route's launch shape


def test_an_engine_with_every_matmul_pinned_to_it_matches_cublas_greedy():
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for name, routes in (("stream", pins(*({"kernel": "stream", "op": op, "rows": [2, 64]} for op in
                                         ("linear", "norm_linear", "norm_linear_silu")))),
                         ("reference", "")):
        kw = dict(kernel_routes=routes) if routes else dict(kernels="reference")
        engine = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                           max_num_seqs=4, max_model_len=64, enforce_eager=DEV == "cpu", **kw)
        outs[name] = [list(s.output_token_ids) for s in engine.generate(prompts, params)]
        engine.close()
    assert outs["stream"] == outs["reference"]
