"""A greedy verification's target ids from the LM head's argmax kernels, without float32 logits:
engine.kernels.matmul.draft_gemv.linear_argmax (the target's LM head + argmax on the decode GEMV, the "gemv" route
of op "head") against the torch ops it replaces, greedy_accept_ids against greedy_accept, which steps of
SpecStepProgram take the kernels, and whole speculative engines with the head's routes pinned (the GEMV; cuBLAS +
engine/kernels/sampling/argmax.py) against the reference (cuBLAS, logits). The plain step's side:
tests/kernels/test_step_head_argmax.py. Without CUDA the kernels run in the Triton CPU interpreter
(tests/conftest.py)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leak, triton_module
from engine.kernels.routes import pins
from helpers import INTERPRETER_SETTINGS, SPEC_DEPTHS, record_drafts

dg = triton_module("matmul.decode_gemv")
dr = triton_module("matmul.draft_gemv")
ops = triton_module("fused_ops")
DEV = "cpu" if dr.interpreted() else "cuda"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (K, vocabulary): 3 programs of 128 rows (the last 44 real), 6 of 64 (13), 9 of 32 (1)
SHAPES = [(64, 300), (96, 333), (192, 257)]


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def torch_argmax(x, w):
    """The verification's ids without the kernels: target.compute_logits(x).argmax(-1) at one rank."""
    return F.linear(x, w).float().argmax(-1)


@pytest.fixture(params=["one_chunk", "chunks"])
def block_p(request, monkeypatch):
    """"chunks": kernel 2 reads 2 partials at a time, so its loop runs several times with a ragged tail."""
    if request.param == "chunks":
        monkeypatch.setattr(triton_module("sampling.argmax"), "BLOCK_P", 2)


@DTYPES
@pytest.mark.parametrize("m", list(range(1, dr.MAX_ROWS + 1)))
def test_linear_argmax_equals_torch(dtype, m, block_p):
    for i, (k, v) in enumerate(SHAPES):
        x = (randn(m, k + 5, seed=i, dtype=dtype) * 3)[:, 2:2 + k]        # strided rows, unit stride in K
        w = randn(v, k, seed=i + 20, dtype=dtype) / k ** 0.5
        assert dr.supports_linear(x, w)
        got = dr.linear_argmax(x, w)
        assert got.dtype == torch.int64 and got.shape == (m,)
        assert torch.equal(got, torch_argmax(x, w)), (k, v)


@DTYPES
def test_equal_rows_give_the_lowest_index(dtype, block_p):
    """Row m's largest logit sits at four equal weight rows: two in the first program, one in the second, the
    last vocabulary rows in the third. The first of them wins, as in torch.argmax."""
    k, v, m = 64, 300, 3
    x, w = randn(m, k, seed=4, dtype=dtype) * 3, randn(v, k, seed=6, dtype=dtype) / k ** 0.5
    for r in range(m):
        a = x[r].float()
        w[[5 + r, 40 + r, 130 + r, v - 1 - r]] = (2 * a / a.norm()).to(dtype)
    got = dr.linear_argmax(x, w)
    assert got.tolist() == [5, 6, 7] and torch.equal(got, torch_argmax(x, w))


@DTYPES
def test_logits_are_compared_as_the_dtype_rounds_them(dtype):
    """x = 1, so a logit is its weight row's sum: 1 (row 50) and 1 + 2^-10 (row 260) are equal in bf16, where the
    first wins, and not in fp32. Every logit negative: the lanes past the vocabulary never win."""
    k, v = 64, 300
    x, w = torch.ones(2, k, dtype=dtype, device=DEV), torch.zeros(v, k, dtype=dtype, device=DEV)
    w[50, 0], w[260, :2] = 1, torch.tensor([1, 2 ** -10], dtype=dtype)
    want = 50 if dtype == torch.bfloat16 else 260
    assert dr.linear_argmax(x, w).tolist() == [want, want] == torch_argmax(x, w).tolist()
    assert dr.linear_argmax(x, w - 4).tolist() == torch_argmax(x, w - 4).tolist()


def test_refusals():
    """Shapes and layouts the kernels cannot take raise ValueError, dtypes TypeError (as decode_gemv's)."""
    x, w = randn(2, 64, seed=1), randn(100, 64, seed=3)
    bad = [((randn(dr.MAX_ROWS + 1, 64, seed=4), w), ValueError, "rows"),
           ((x, randn(100, 63, seed=5)), ValueError, "does not fit"),
           ((x, randn(100, 70, seed=6)[:, :64]), ValueError, "contiguous"),
           ((randn(64, 2, seed=7).t(), w), ValueError, "unit stride"), ((x[0], w), ValueError, "2-D"),
           ((x, w.to(torch.bfloat16)), TypeError, "dtype"), ((x.long(), w.long()), TypeError, "dtype")]
    for args, error, match in bad:
        if args[0].dim() == 2 and args[0].is_floating_point():
            assert not dr.supports_linear(*args)
        with pytest.raises(error, match=match):
            dr.linear_argmax(*args)


def _backend(kernel: str):
    """A Triton backend with the LM head (op "head") pinned to `kernel`."""
    from engine.backend import RoutedBackend
    from engine.kernels.routes import Pin, RouteTable
    return RoutedBackend(routes=RouteTable.pinned(Pin(kernel, op="head")))


def test_backend_dispatch(monkeypatch):
    """The GEMV kernels on a Triton backend with the head pinned to them, up to their MAX_ROWS rows; cuBLAS's logits
    and engine/kernels/sampling/argmax.py past them and pinned to cuBLAS; None with the reference table and on the
    torch backend (the caller computes the logits)."""
    from engine.backend import RoutedBackend, TorchBackend
    from engine.kernels.routes import RouteTable
    calls, real = [], dr.linear_argmax
    monkeypatch.setattr(dr, "linear_argmax", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    x, w, wide = randn(4, 64, seed=1), randn(100, 64, seed=3), randn(dr.MAX_ROWS + 1, 64, seed=4)
    assert torch.equal(_backend("gemv").linear_argmax(x, w), torch_argmax(x, w)) and calls == [4]
    for backend, rows in [(_backend("gemv"), wide), (_backend("cublas"), x)]:
        assert torch.equal(backend.linear_argmax(rows, w), torch_argmax(rows, w))
    assert calls == [4]
    assert RoutedBackend(routes=RouteTable(reference=True)).linear_argmax(x, w) is None
    assert TorchBackend().linear_argmax(x, w) is None


# ---- greedy acceptance from ids ----

def test_greedy_accept_ids_equals_greedy_accept():
    from engine.speculative.verify import greedy_accept, greedy_accept_ids
    g = torch.Generator().manual_seed(0)
    for case in range(40):
        n, k, v = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)), 7
        logits = torch.randint(-3, 4, (n, k + 1, v), generator=g).float()        # small integers: many ties
        target = logits.argmax(-1)
        other = torch.randint(0, v, (n, k), generator=g)
        drafts = torch.where(torch.rand(n, k, generator=g) < 0.7, target[:, :k], other)
        num_drafts = torch.randint(-1, k + 2, (n,), generator=g)                  # clamped to [0, K]
        want = greedy_accept(drafts, logits, num_drafts)
        got = greedy_accept_ids(drafts, target, num_drafts)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), case


def test_greedy_accept_ids_refuses_bad_shapes():
    from engine.speculative.verify import greedy_accept_ids
    drafts, ids, n = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), torch.ones(2).long()
    bad = [((drafts, ids[:, :3], n), "target_ids"), ((drafts, ids.float(), n), "target_ids"),
           ((drafts.float(), ids, n), "draft_tokens"), ((drafts, ids, n[:1]), "num_drafts"),
           ((drafts[:, :0], ids[:, :1], n), "K >= 1")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            greedy_accept_ids(*args)


# ---- which steps take the kernels ----

def _program(kernels: bool, world: int = 1):
    """SpecStepProgram's attributes target_ids reads, with a backend counting its linear_argmax calls (kernels:
    it has a head kernel for them, else None as the reference table's)."""
    calls = []
    backend = SimpleNamespace(linear_argmax=lambda x, w: calls.append(x.shape[0]) or (
        torch.zeros(x.shape[0]).long() if kernels else None))
    model = SimpleNamespace(tp=SimpleNamespace(world=world), head_weight=torch.zeros(10, 8))
    return SimpleNamespace(backend=backend, model=model), calls


@pytest.mark.parametrize("variant,world,k,kernels", [
    ((False, True, False), 1, 3, True), ((True, True, False), 1, 3, True), ((False, False, False), 1, 3, True),
    ((False, True, True), 1, 3, True), ((False, True, False), 2, 3, True), ((False, True, False), 1, 0, True),
    ((False, True, False), 1, 3, False)],
    ids=["greedy", "guided", "sampled", "extras", "tp2", "plain_step", "reference"])
def test_only_greedy_unguided_steps_without_extras_skip_the_logits(variant, world, k, kernels):
    from engine.runner.spec_step import SpecStepProgram
    from engine.runner.step import StepVariant
    program, calls = _program(kernels, world)
    got = SpecStepProgram.target_ids(program, torch.zeros(k + 1, 8), StepVariant(*variant), k + 1, 1, k)
    asked = variant == (False, True, False) and world == 1 and k
    assert (got is not None) == bool(asked and kernels) and calls == ([k + 1] if asked else [])
    if got is not None:
        assert got.shape == (1, k + 1)


# ---- whole engines ----

PROMPT = [5, 17, 99, 3, 250, 42, 7, 5, 17, 99]      # n-gram drafts from its repeat


def _counting(monkeypatch):
    calls = []
    real = dr.linear_argmax
    monkeypatch.setattr(dr, "linear_argmax", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    return calls


# every other matmul on cuBLAS too: on a GPU the tuner's routes would round the logprobs differently
CUBLAS = dict(kernel="cublas")
ROUTES = {"reference": dict(kernels="reference"),                                     # cuBLAS, the logits
          "cublas": dict(kernel_routes=pins(CUBLAS)),                                     # cuBLAS + argmax.py
          "gemv": dict(kernel_routes=pins(CUBLAS, dict(kernel="gemv", op="head", rows=[1, 8])))}  # the GEMV's argmax


def _engine(speculative, depth, routes):
    from engine.llm_engine import LLMEngine
    return LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                     **INTERPRETER_SETTINGS, depth=depth,
                     max_num_seqs=4, max_model_len=64, enforce_eager=True, speculative=speculative,
                     spec_head="random", num_speculative_tokens=3, spec_min_acceptance=0.0, **ROUTES[routes])


def _spying(eng):
    """The engine's drafts, and the K of each spec step that computed its logits."""
    program, drafts, logit_ks = eng.runner.program, record_drafts(eng.runner.program.drafter), []
    spec_logits = program.spec_logits
    program.spec_logits = lambda *a, **kw: logit_ks.append(a[5]) or spec_logits(*a, **kw)   # a[5]: K
    return drafts, logit_ks


@pytest.mark.parametrize("speculative,depth", SPEC_DEPTHS)
def test_engine_outputs_equal_across_head_routes(speculative, depth, monkeypatch):
    """One stream, K = 3 (4 rows a verification): the head pinned to the GEMV (its argmax; n-gram engine) and to
    cuBLAS (its logits, engine/kernels/sampling/argmax.py) give the drafts and greedy outputs of the reference,
    and their greedy spec steps compute no float32 logits; only the GEMV's take the GEMV. A sampled stream and a
    greedy one with logprobs keep their logits on spec steps, with the same tokens and logprobs."""
    from engine.requests.sequence import SamplingParams
    calls = _counting(monkeypatch)
    requests = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
                SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)]
    runs = {}
    # the GEMV's head on the n-gram engine only; EAGLE with it: tests/kernels/test_spec_finish.py
    for routes in ("reference", "cublas") + (("gemv",) if speculative == "ngram" else ()):
        eng = _engine(speculative, depth, routes)
        drafts, logit_ks = _spying(eng)
        outs, taken, spec_logits = [], [], []
        for params in requests:                 # one stream at a time: each verification has 4 rows
            before, ks = len(calls), len(logit_ks)
            outs.append(eng.generate([PROMPT], params)[0])
            taken.append(len(calls) - before)
            spec_logits.append(sum(k > 0 for k in logit_ks[ks:]))
        assert_no_leak(eng)
        assert drafts and spec_logits[1] and spec_logits[2] and taken[1:] == [0, 0]
        assert (taken[0] > 0, spec_logits[0] > 0) == (routes == "gemv", routes == "reference")
        runs[routes] = ([s.output_token_ids for s in outs], outs[2].logprobs,
                        [d.draft_tokens.tolist() for d in drafts])
    assert all(run == runs["reference"] for run in runs.values())
    assert (4 in calls and set(calls) <= {1, 4}) if speculative == "ngram" else not calls   # plain steps: 1 row
