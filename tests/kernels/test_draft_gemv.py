"""engine.kernels.matmul.draft_gemv (a greedy draft's final norm + LM head + argmax) and decode_gemv's residual epilogue
against the torch ops they replace, bit for bit, and EAGLE drafting with them (the GEMV pinned for the draft's
"norm_head") against drafting without. Without CUDA the kernels run in the Triton CPU interpreter
(tests/conftest.py)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leak, triton_module
from helpers import INTERPRETER_SETTINGS, eagle_target, greedy_drafts, random_eagle_head

dg = triton_module("matmul.decode_gemv")
dr = triton_module("matmul.draft_gemv")
ops = triton_module("fused_ops")
DEV = "cpu" if dr.interpreted() else "cuda"
EPS = 1e-5
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# (K, vocabulary): 3 programs of 128 rows (the last 44 real), 6 of 64 (13), 9 of 32 (1)
SHAPES = [(64, 300), (96, 333), (192, 257)]


def randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def torch_argmax(x, nw, w, eps=EPS):
    """A draft's token without the kernels: target.compute_logits(target.final_norm(x, backend)).argmax(-1)."""
    return F.linear(ops.rms_norm(x, nw, eps), w).float().argmax(-1)


@pytest.fixture(params=["one_chunk", "chunks"])
def block_p(request, monkeypatch):
    """"chunks": kernel 2 reads 2 partials at a time, so its loop runs several times with a ragged tail."""
    if request.param == "chunks":
        monkeypatch.setattr(triton_module("sampling.argmax"), "BLOCK_P", 2)


@DTYPES
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_argmax_equals_torch(dtype, m, block_p):
    for i, (k, v) in enumerate(SHAPES):
        x = (randn(m, k + 5, seed=i, dtype=dtype) * 3)[:, 2:2 + k]        # strided rows, unit stride in K
        nw, w = randn(k, seed=i + 10, dtype=dtype), randn(v, k, seed=i + 20, dtype=dtype) / k ** 0.5
        got = dr.norm_linear_argmax(x, nw, EPS, w)
        assert got.dtype == torch.int64 and got.shape == (m,)
        assert torch.equal(got, torch_argmax(x, nw, w)), (k, v)


@pytest.mark.parametrize("m", [1, 4])
def test_ids_map_the_rows_to_token_ids(m, block_p):
    """A draft vocabulary: weight holds its rows of the LM head, ids their token ids; the kernels write the id."""
    k, v = SHAPES[1]
    x, nw, w = randn(m, k, seed=4), randn(k, seed=5), randn(v, k, seed=6) / k ** 0.5
    ids = torch.randperm(4 * v, generator=torch.Generator().manual_seed(7))[:v].to(DEV)
    assert torch.equal(dr.norm_linear_argmax(x, nw, EPS, w, ids), ids[torch_argmax(x, nw, w)])
    assert torch.equal(dr.linear_argmax(x, w, ids), ids[F.linear(x, w).float().argmax(-1)])
    with pytest.raises(ValueError, match="columns"):
        dr.linear_argmax(x, w, ids[1:])
    rows = torch.full((3, m), -5, dtype=torch.int64, device=DEV)     # a drafter's [K, S] drafts: row 1 is this draft
    assert dr.norm_linear_argmax(x, nw, EPS, w, ids, out=rows[1]) is not None
    assert torch.equal(rows[1], ids[torch_argmax(x, nw, w)]) and (rows[0] == -5).all() and (rows[2] == -5).all()
    for bad in (rows[1, 1:], rows[1].int(), torch.empty(2 * m, dtype=torch.int64, device=DEV)[::2]):
        with pytest.raises(ValueError, match="out must be int64"):
            dr.norm_linear_argmax(x, nw, EPS, w, ids, out=bad)


@DTYPES
def test_masked_rows_never_win(dtype, block_p):
    """Every logit negative: the lanes past the vocabulary (their products are 0) must not be the maximum."""
    k, v = 64, 300
    x, nw = randn(3, k, seed=1, dtype=dtype).abs() + 0.1, randn(k, seed=2, dtype=dtype).abs() + 0.1
    w = -(randn(v, k, seed=3, dtype=dtype).abs() + 0.1)
    got = dr.norm_linear_argmax(x, nw, EPS, w)
    assert torch.equal(got, torch_argmax(x, nw, w)) and (got < v).all()
    assert dr.norm_linear_argmax(x, nw, EPS, w[:1]).tolist() == [0, 0, 0]


@DTYPES
def test_equal_rows_give_the_lowest_index(dtype, block_p):
    """Row m's largest logit sits at four equal weight rows: two in the first program, one in the second, the
    last vocabulary rows in the third. The first of them wins, as in torch.argmax."""
    k, v, m = 64, 300, 3
    x, nw = randn(m, k, seed=4, dtype=dtype) * 3, randn(k, seed=5, dtype=dtype)
    w = randn(v, k, seed=6, dtype=dtype) / k ** 0.5
    a = ops.rms_norm(x, nw, EPS).float()
    for r in range(m):
        w[[5 + r, 40 + r, 130 + r, v - 1 - r]] = (2 * a[r] / a[r].norm()).to(dtype)
    got = dr.norm_linear_argmax(x, nw, EPS, w)
    assert got.tolist() == [5, 6, 7] and torch.equal(got, torch_argmax(x, nw, w))


@DTYPES
@pytest.mark.parametrize("case", ["rounded_tie", "nearest_even"])
def test_logits_are_compared_as_the_dtype_rounds_them(dtype, case):
    """x = 1 after the norm, so a logit is its weight row's sum, exact in fp32. "rounded_tie": 1 (row 50) and
    1 + 2^-10 (row 260) are equal in bf16. "nearest_even": 1 + 3 * 2^-9 (row 20) rounds up to 1 + 2^-7 (row 100)
    in bf16; truncated (the interpreter's own cast), it would be 1 and lose."""
    k, v = 64, 300
    x, nw = torch.ones(2, k, dtype=dtype, device=DEV), torch.ones(k, dtype=dtype, device=DEV)
    w = torch.zeros(v, k, dtype=dtype, device=DEV)
    rows = {"rounded_tie": {50: [1], 260: [1, 2 ** -10]},
            "nearest_even": {20: [1, 2 ** -8, 2 ** -9], 100: [1, 2 ** -7]}}
    for row, values in rows[case].items():
        w[row, :len(values)] = torch.tensor(values, dtype=dtype)
    want = {("rounded_tie", torch.bfloat16): 50, ("rounded_tie", torch.float32): 260,
            ("nearest_even", torch.bfloat16): 20, ("nearest_even", torch.float32): 100}[case, dtype]
    got = dr.norm_linear_argmax(x, nw, 0.0, w)
    assert got.tolist() == [want, want] and torch.equal(got, torch_argmax(x, nw, w, eps=0.0))


@DTYPES
@pytest.mark.parametrize("m", [1, 4])
def test_residual_epilogue_equals_the_add_after(dtype, m):
    """hidden + silu_linear(gate_up, w) of the EAGLE head's layer: one kernel, the same bits as the matmul's
    output added to the residual by torch; on the backend with the GEMV pinned too (silu_mul's kernel, then the
    GEMV's residual epilogue)."""
    gu, w, r = (randn(m, 2 * 96, seed=7, dtype=dtype), randn(72, 96, seed=8, dtype=dtype),
                randn(m, 72, seed=9, dtype=dtype))
    assert dg.supports(gu, w, k=96, add=r)
    got = dg.decode_silu_linear(gu, w, residual=r)
    assert torch.equal(got, r + dg.decode_silu_linear(gu, w))
    act = ops.silu_mul(gu)
    assert torch.equal(_backend(True).silu_linear(gu, w, residual=r), r + dg.decode_linear(act, w))


@DTYPES
def test_outputs_round_as_torch_rounds(dtype):
    """Integer operands: the fp32 sums are exact in any order, so the outputs (up to 16384, most not bf16
    numbers) and their sums with a residual are torch's bit for bit, ties to even included."""
    g = torch.Generator(device=DEV).manual_seed(10)
    x = torch.randint(-16, 17, (3, 64), generator=g, device=DEV).to(dtype)
    w = torch.randint(-16, 17, (300, 64), generator=g, device=DEV).to(dtype)
    r = torch.randint(-300, 301, (3, 300), generator=g, device=DEV).to(dtype)
    assert torch.equal(dg.decode_linear(x, w), F.linear(x, w))
    assert torch.equal(dg.launch(x, w, 64, "none", add=r, epilogue="add")[0], r + F.linear(x, w))


def test_refusals():
    x, nw, w = randn(2, 64, seed=1), randn(64, seed=2), randn(100, 64, seed=3)
    assert dr.supports(x, nw, w) and dr.supports(randn(dr.MAX_ROWS, 64, seed=4), nw, w)
    assert not dr.supports(randn(dr.MAX_ROWS + 1, 64, seed=4), nw, w) and not dr.supports(x, None, w)
    bad = [((randn(dr.MAX_ROWS + 1, 64, seed=4), nw, w), "rows"), ((x, nw, randn(100, 63, seed=5)), "does not fit"),
           ((x, nw, randn(100, 70, seed=6)[:, :64]), "contiguous"), ((x, randn(65, seed=7), w), "norm_weight"),
           ((x[0], nw, w), "2-D"), ((x, nw[None], w), "norm_weight must be 1-D")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            dr.norm_linear_argmax(args[0], args[1], EPS, args[2])
    gu, wd = randn(2, 128, seed=8), randn(100, 64, seed=9)
    for res in (randn(2, 101, seed=10), randn(2, 100, seed=10).to(torch.bfloat16), randn(100, 2, seed=11).t()):
        assert not dg.supports(gu, wd, k=64, add=res)
        with pytest.raises(ValueError, match="residual"):
            dg.decode_silu_linear(gu, wd, residual=res)


def test_backend_runs_the_heads_pinned_kernel(monkeypatch):
    """The backend's normed head takes the GEMV's kernels where its route pins them and they take the rows; past
    their rows, and pinned to cuBLAS, the head's tokens are the argmax kernels' on cuBLAS's logits; the reference
    table and the torch backend have no argmax kernel (None: the caller computes the logits)."""
    from engine.backend import RoutedBackend, TorchBackend
    from engine.kernels.routes import RouteTable
    x, nw, w = randn(2, 64, seed=1), randn(64, seed=2), randn(100, 64, seed=3)
    calls = _counting(monkeypatch)
    backend = _backend(True)
    assert torch.equal(backend.norm_linear_argmax(x, nw, EPS, w), torch_argmax(x, nw, w)) and calls == [2]
    wide = randn(dr.MAX_ROWS + 1, 64, seed=4)
    assert torch.equal(backend.norm_linear_argmax(wide, nw, EPS, w), torch_argmax(wide, nw, w))
    assert torch.equal(_backend(False).norm_linear_argmax(x, nw, EPS, w), torch_argmax(x, nw, w))
    assert calls == [2]
    assert RoutedBackend(routes=RouteTable(reference=True)).norm_linear_argmax(x, nw, EPS, w) is None
    assert TorchBackend().norm_linear_argmax(x, nw, EPS, w) is None


def _backend(draft: bool):
    """A Triton backend with the GEMV pinned for every matmul, and for the heads with `draft`, else cuBLAS's
    logits and the argmax kernels."""
    from engine.backend import RoutedBackend
    from engine.kernels.routes import Pin, RouteTable
    cublas = [] if draft else [Pin("cublas", op="head"), Pin("cublas", op="norm_head")]
    return RoutedBackend(routes=RouteTable.pinned(Pin("gemv"), *cublas))


# ---- the EAGLE head and drafter ----

TINY = dict(model_type="llama", vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=True)
BS, PAGES = 4, 16


def _parts(tied: bool, dtype, draft: bool):
    from engine.models.llama import LlamaForCausalLM
    from engine.models.weights import _init_dummy
    from engine.speculative.drafters.eagle import EagleDrafter
    from engine.speculative.eagle_paged import PagedHead
    cfg = dict(TINY, tie_word_embeddings=tied)
    target = LlamaForCausalLM(cfg)
    _init_dummy(target, seed=0)
    target = target.to(DEV, dtype)
    target.init_rope(128, torch.device(DEV))
    paged = PagedHead(random_eagle_head(cfg).to(DEV, dtype), target, _backend(draft), PAGES, BS, 128)
    return target, EagleDrafter(3, paged, BS, 128)


def _ctx(n, dtype, guide=None):
    """One sequence's prompt of n tokens (pages 5, 2, 9, ...), drafting from its last."""
    from engine.attention import AttentionMetadata
    from engine.speculative.drafters.base import FeatureContext
    g = torch.Generator().manual_seed(n)
    table = torch.tensor([[5, 2, 9, 1, 12, 7, 3, 0]], dtype=torch.int32)
    pos = torch.arange(n)
    slots = table[0, pos // BS].long() * BS + pos % BS
    meta = AttentionMetadata(slots.to(DEV), torch.tensor([0, n], dtype=torch.int32, device=DEV),
                             torch.tensor([n], dtype=torch.int32, device=DEV), table.to(DEV), n, n)
    return FeatureContext(next_ids=torch.randint(0, TINY["vocab_size"], (n,), generator=g).to(DEV),
                          positions=pos.to(DEV),
                          meta=meta, last=torch.tensor([n - 1], device=DEV), last_seq=torch.tensor([0], device=DEV),
                          last_valid=torch.ones(1, dtype=torch.bool, device=DEV),
                          kv_cap=torch.tensor([table.shape[1] * BS], device=DEV),
                          features=(torch.randn(n, 3 * TINY["hidden_size"], generator=g) * 3).to(DEV, dtype),
                          guide=guide)


def _counting(monkeypatch):
    calls = []
    real = dr.norm_linear_argmax
    monkeypatch.setattr(dr, "norm_linear_argmax", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    return calls


@DTYPES
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "lm_head"])
def test_head_greedy_equals_the_logits_argmax(dtype, tied, monkeypatch):
    target, drafter = _parts(tied, dtype, True)
    hidden = randn(3, TINY["hidden_size"], seed=12, dtype=dtype) * 2
    head = drafter.head
    assert torch.equal(head.greedy(hidden), head.logits(hidden).argmax(-1))
    wide = randn(dr.MAX_ROWS + 1, TINY["hidden_size"], seed=13, dtype=dtype)    # past the GEMV: the argmax kernels
    assert torch.equal(head.greedy(wide), head.logits(wide).argmax(-1))
    monkeypatch.setattr(target, "tp", SimpleNamespace(world=2))        # the vocabulary gathered over ranks
    assert head.greedy(hidden) is None


@DTYPES
def test_drafts_with_and_without_the_kernels_agree(dtype, monkeypatch):
    """The same drafts from a prompt, K = 3 (step 0 and two draft steps); with the GEMV pinned for the head every
    pick is the kernels', except in a guided step, which keeps ctx.pick on the logits."""
    calls = _counting(monkeypatch)
    drafts = {}
    for draft in (False, True):
        _, drafter = _parts(True, dtype, draft)
        with torch.no_grad():
            drafts[draft] = drafter.propose(_ctx(11, dtype)).draft_tokens
    assert torch.equal(drafts[True], drafts[False]) and calls == [1, 1, 1]
    guide = SimpleNamespace(pick=lambda j, logits: logits.argmax(-1), num_drafts=lambda: torch.tensor([3]))
    with torch.no_grad():
        guided = drafter.propose(_ctx(11, dtype, guide)).draft_tokens
    assert torch.equal(guided, drafts[True]) and calls == [1, 1, 1]


def test_engine_drafts_and_outputs_equal_with_draft_gemv(tmp_path, monkeypatch):
    """A whole engine (Triton backend, an EAGLE head on a 3-layer dummy target, the GEMV pinned for every matmul):
    the GEMV pinned for the draft heads too gives the drafts and greedy outputs of cuBLAS's logits there, and its
    draft steps take the kernels."""
    from engine.kernels.routes import pins
    from engine.llm_engine import LLMEngine
    head_dir = eagle_target(monkeypatch, tmp_path)
    calls = _counting(monkeypatch)
    gemv = dict(kernel="gemv", rows=[1, 8])
    runs = {}
    for draft in (False, True):
        routes = pins(gemv) if draft else pins(gemv, dict(kernel="cublas", op="norm_head"))
        eng = LLMEngine(model="dummy:tiny3", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, depth=1, max_num_seqs=4, max_model_len=128, enforce_eager=True,
                        speculative="eagle", spec_head=head_dir, kernel_routes=routes)
        runs[draft] = greedy_drafts(eng, [[5, 17, 99, 3, 250, 42, 7], [300, 1, 2]], (4, 3))
        assert_no_leak(eng)
        assert runs[draft][1] and (len(calls) > 0) == draft
    assert runs[True] == runs[False] and 2 in calls        # both prompts' drafts in one call
