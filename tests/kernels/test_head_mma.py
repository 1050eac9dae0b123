"""engine.kernels.matmul.head_mma (a greedy step's LM head argmax on tensor cores, no logits) against F.linear and
torch.argmax, and the backend and engines running it where the route table pins it for the LM heads ("head",
"norm_head"). Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leak, triton_module
from helpers import eagle_target, greedy_drafts

hm = triton_module("matmul.head_mma")
DEV = "cpu" if hm.interpreted() else "cuda"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (K, vocabulary): K of one ragged chunk, of two and a half, of three; the last vocabulary block partly masked
SHAPES = [(48, 300), (160, 333), (192, 257)]
CONFIGS = [dict(BLOCK_V=128, BLOCK_K=64, PRELOAD=False, num_warps=4, num_stages=1),
           dict(BLOCK_V=64, BLOCK_K=32, PRELOAD=True, num_warps=4, num_stages=1)]


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def torch_argmax(x, w):
    return F.linear(x, w).float().argmax(-1)


def _run(x, w, config, ids=None):
    return hm.first_max(*hm.partials(x, w, config), ids)


@DTYPES
@pytest.mark.parametrize("m", [1, 5, 17, 32, 64])
@pytest.mark.parametrize("config", CONFIGS, ids=["v128", "v64_preload"])
def test_argmax_equals_torch(dtype, m, config):
    for i, (k, v) in enumerate(SHAPES):
        x = (randn(m, k + 5, seed=i, dtype=dtype) * 3)[:, 2:2 + k]        # strided rows, unit stride in K
        w = randn(v, k, seed=i + 20, dtype=dtype) / k ** 0.5
        got = _run(x, w, config)
        assert got.dtype == torch.int64 and got.shape == (m,)
        assert torch.equal(got, torch_argmax(x, w)), (k, v)
    assert torch.equal(hm.linear_argmax(x, w), torch_argmax(x, w))        # the default config


def test_ids_map_the_rows_to_token_ids():
    k, v = SHAPES[1]
    x, w = randn(6, k, seed=4), randn(v, k, seed=6) / k ** 0.5
    ids = torch.randperm(4 * v, generator=torch.Generator().manual_seed(7))[:v].to(DEV)
    assert torch.equal(hm.linear_argmax(x, w, ids), ids[torch_argmax(x, w)])
    with pytest.raises(ValueError, match="columns"):
        hm.linear_argmax(x, w, ids[1:])


@DTYPES
@pytest.mark.parametrize("config", CONFIGS, ids=["v128", "v64_preload"])
def test_masked_rows_never_win_and_ties_give_the_lowest_row(dtype, config):
    """Every logit negative: the masked lanes (products 0) past the vocabulary must not win. Then integer
    operands (exact sums in any order): row m's largest logit at four equal weight rows in three programs; the
    first of them wins, as in torch.argmax."""
    k, v, m = 64, 300, 6
    x = randn(m, k, seed=1, dtype=dtype).abs() + 0.1
    w = -(randn(v, k, seed=3, dtype=dtype).abs() + 0.1)
    got = _run(x, w, config)
    assert torch.equal(got, torch_argmax(x, w)) and (got < v).all()
    assert _run(x, w[:1], config).tolist() == [0] * m
    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.zeros(m, k, device=DEV)
    for r in range(m):          # row r's values in its own ten columns: another row's tie rows give it 0
        x[r, 10 * r:10 * r + 10] = torch.randint(1, 4, (10,), generator=g, device=DEV).float()
    w = torch.randint(-1, 2, (v, k), generator=g, device=DEV).float()      # |logit| <= 30
    for r in range(m):
        w[[5 + r, 70 + r, 130 + r, v - 1 - r]] = 8 * x[r]                  # logit >= 80
    x, w = x.to(dtype), w.to(dtype)
    got = _run(x, w, config)
    assert got.tolist() == [5 + r for r in range(m)] and torch.equal(got, torch_argmax(x, w))


@DTYPES
def test_logits_are_compared_as_the_dtype_rounds_them(dtype):
    """x = 1, so a logit is its weight row's sum, exact in fp32. 1 (row 50) and 1 + 2^-10 (row 260) are equal in
    bf16: row 50 wins there, row 260 in fp32. 1 + 3 * 2^-9 (row 20) rounds up to 1 + 2^-7 (row 100) in bf16."""
    k, v = 64, 300
    x, w = torch.ones(2, k, dtype=dtype, device=DEV), torch.zeros(v, k, dtype=dtype, device=DEV)
    for row, values in {50: [1], 260: [1, 2 ** -10]}.items():
        w[row, :len(values)] = torch.tensor(values, dtype=dtype)
    want = 50 if dtype == torch.bfloat16 else 260
    assert hm.linear_argmax(x, w).tolist() == [want, want] and torch.equal(hm.linear_argmax(x, w), torch_argmax(x, w))
    w.zero_()
    for row, values in {20: [1, 2 ** -8, 2 ** -9], 100: [1, 2 ** -7]}.items():
        w[row, :len(values)] = torch.tensor(values, dtype=dtype)
    want = 20 if dtype == torch.bfloat16 else 100
    assert hm.linear_argmax(x, w).tolist() == [want, want]


def test_refusals():
    x, w = randn(5, 64, seed=1), randn(100, 64, seed=3)
    assert hm.supports(x, w) and hm.supports(randn(hm.MAX_ROWS, 64, seed=4), w)
    bad = [((randn(hm.MAX_ROWS + 1, 64, seed=4), w), ValueError, "rows"),
           ((x, randn(100, 63, seed=5)), ValueError, "does not fit"),
           ((x, randn(100, 70, seed=6)[:, :64]), ValueError, "contiguous"),
           ((x, w.to(torch.bfloat16)), TypeError, "dtype")]
    for args, error, match in bad:
        assert not hm.supports(*args)
        with pytest.raises(error, match=match):
            hm.linear_argmax(*args)
    with pytest.raises(ValueError, match="2-D"):
        hm.linear_argmax(x[0], w)


def _counting(monkeypatch):
    calls, real = [], hm.linear_argmax
    monkeypatch.setattr(hm, "linear_argmax", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    return calls


@pytest.mark.parametrize("kernel", ["mma", "gemv", "cublas"])
def test_the_backend_runs_head_mma_where_pinned(kernel, monkeypatch):
    """With the heads pinned to "mma" the backend's greedy LM head takes head_mma up to its MAX_ROWS, the final
    norm first where there is one, and steps past MAX_ROWS take cuBLAS's logits; pinned to the GEMV or cuBLAS,
    never head_mma. The same tokens on every route."""
    from engine.backend import RoutedBackend
    from engine.kernels.routes import Pin, RouteTable
    ops = triton_module("fused_ops")
    calls = _counting(monkeypatch)
    k, v = SHAPES[1]
    w, nw = randn(v, k, seed=1) / k ** 0.5, randn(k, seed=2)
    backend = RoutedBackend(routes=RouteTable.pinned(Pin(kernel, op="head"), Pin(kernel, op="norm_head")))
    for rows in (1, 4, 5, hm.MAX_ROWS, hm.MAX_ROWS + 1):
        x = randn(rows, k, seed=rows)
        assert torch.equal(backend.linear_argmax(x, w), torch_argmax(x, w))
        assert torch.equal(backend.norm_linear_argmax(x, nw, 1e-5, w), torch_argmax(ops.rms_norm(x, nw, 1e-5), w))
    assert calls == ([1, 1, 4, 4, 5, 5, hm.MAX_ROWS, hm.MAX_ROWS] if kernel == "mma" else []), calls


PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2], list(range(40, 61)), [11] * 5, [8, 1, 64, 64, 2]]


def _tokens(counted: list | None = None, **kw):
    """counted: a list of kernel calls, emptied once the engine is built (its route tuner times the kernels too)."""
    from engine.llm_engine import LLMEngine
    from engine.requests.sequence import SamplingParams
    eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton", depth=2,
                    enforce_eager=True, max_num_seqs=5, max_model_len=128, **kw)
    if counted is not None:
        counted.clear()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 6, 7)]
    out = [s.output_token_ids for s in eng.generate(PROMPTS, params)]
    assert_no_leak(eng)
    return out


@pytest.fixture(scope="module")
def reference():
    """cuBLAS for every matmul, the head's tokens from its logits."""
    return _tokens(kernels="reference")


@pytest.mark.parametrize("rows", [(1, 64), (5, 64), (1, 4)])
def test_engine_outputs_equal_with_head_mma(rows, reference, monkeypatch):
    """head_mma pinned for the LM head's steps of `rows` (the GEMV's below them) gives the reference's greedy
    tokens; steps of five rows take it where the pin reaches five, steps of fewer rows, as requests finish,
    where it starts at one."""
    from engine.kernels.routes import pins
    calls = _counting(monkeypatch)
    routes = [dict(kernel="gemv", op="head", rows=[1, 4])] if rows[0] > 1 else []
    routes.append(dict(kernel="mma", op="head", rows=list(rows)))
    assert _tokens(calls, kernel_routes=pins(*routes)) == reference
    assert (5 in calls, any(r < 5 for r in calls)) == (rows[1] >= 5, rows[0] == 1), calls


def test_eagle_engine_outputs_equal_with_head_mma_on_every_head(tmp_path, monkeypatch):
    """An EAGLE engine (a 3-layer dummy target) with head_mma pinned for every head: its drafts' normed heads and
    the verifications take head_mma, and the drafts and greedy outputs are the reference's (cuBLAS, logits)."""
    from engine.kernels.routes import pins
    from engine.llm_engine import LLMEngine
    head_dir = eagle_target(monkeypatch, tmp_path)
    calls = _counting(monkeypatch)
    mma = pins(dict(kernel="mma", op="head"), dict(kernel="mma", op="norm_head"))
    runs = {}
    for on in (False, True):
        kw = dict(kernel_routes=mma) if on else dict(kernels="reference")
        eng = LLMEngine(model="dummy:tiny3", device=DEV, dtype="float32", attention_backend="triton", depth=1,
                        max_num_seqs=4, max_model_len=128, enforce_eager=True, speculative="eagle",
                        num_speculative_tokens=3, spec_head=head_dir, **kw)
        runs[on] = greedy_drafts(eng, [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2]], (5, 4))
        assert_no_leak(eng)
        # each spec step: three draft heads of both prompts' rows, then one verification of 2 x 4 rows
        assert runs[on][1] and (calls.count(2) >= 3 * calls.count(8) > 0) == on, calls
    assert runs[True] == runs[False]
