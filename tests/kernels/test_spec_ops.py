"""engine.kernels.speculative.spec_ops (the speculative step's correction and draft layout, one kernel each) against the
torch code they replace (SpecStepProgram.correct with TokenPool.carried, drafters/base.py draft_layout), bit for bit,
and whole engines with Tuning.spec_kernels on against off. Without CUDA the kernels run in the Triton CPU
interpreter (tests/conftest.py)."""
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_no_leak, triton_module
from helpers import INTERPRETER_SETTINGS, SPEC_DEPTHS, greedy_drafts

so = triton_module("speculative.spec_ops")
nd = triton_module("speculative.ngram_draft")
DEV = "cpu" if so.interpreted() else "cuda"
BS, MML = 4, 40                 # block size, max_model_len
MAX_BLOCKS = (MML + 8) // BS    # room for positions a little past max_model_len


def _ints(g, low, high, n):
    return torch.randint(low, high, (n,), generator=g)


def _pool(g, rows, k):
    from engine.speculative.state import SpecState
    st = SpecState(rows, MML, k, torch.device("cpu"))
    st.last_token.copy_(_ints(g, 0, 500, rows + 1))
    st.drafts.copy_(torch.randint(0, 500, st.drafts.shape, generator=g))
    st.rejected.copy_(_ints(g, 0, k + 1, rows + 1))
    st.history.copy_(torch.randint(0, 500, st.history.shape, generator=g))
    st.draft_count.copy_(_ints(g, 0, k + 1, rows + 1))
    return st


def _step(seed, T, B, S, k, rows=8):
    """A slot's device tensors for a step of T tokens, B sequences and S sampling rows, each buffer a few entries
    longer than the step. Real sequences have distinct pool rows and consecutive positions, some reaching
    max_model_len; the rest are graph padding (-1 rows, position 0, no shift: positions never go negative), some
    of which carry tokens or shift sampling steps anyway (torch reads the dummy row there, and so must the
    kernel)."""
    g = torch.Generator().manual_seed(seed)
    st = _pool(g, rows, k)
    real = min(B - 1, rows) if B > 1 else B
    pool_rows = torch.randperm(rows, generator=g)[:real]
    n = T + 3
    d = dict(input_ids=_ints(g, 0, 500, n), positions=torch.zeros(n, dtype=torch.int64),
             slot_mapping=torch.full((n,), -1), carry_src=_ints(g, -1, max(k, 2) + 1, n), tok_row=torch.full((n,), -1),
             tok_seq=torch.zeros(n, dtype=torch.int64), shift=torch.zeros(n, dtype=torch.int64))
    cuts = sorted(_ints(g, 0, T + 1, real).tolist()) if real else []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:] + [T])):
        row = int(pool_rows[i])
        top = MML + 2 - (b - a)         # the first sequence ends past max_model_len
        base = (top if i == 0 else int(_ints(g, 0, top, 1))) + int(st.rejected[row])
        d["positions"][a:b] = torch.arange(base, base + b - a)
        d["slot_mapping"][a:b] = torch.where(_ints(g, 0, 5, b - a) > 0, _ints(g, 0, 999, b - a), -1)
        d["tok_row"][a:b], d["tok_seq"][a:b] = row, i
        d["shift"][a:b] = int(_ints(g, 0, 2, 1))
    m = B + 2
    d["seq_lens"] = _ints(g, k, 200, m).int()
    d["seq_shift"] = torch.full((m,), -1)
    d["seq_shift"][:real] = torch.where(_ints(g, 0, 2, real) > 0, pool_rows, -1)
    m = S + 2
    d["steps"], d["smp_shift"], d["num_drafts"] = _ints(g, k, 200, m), _ints(g, 0, 2, m), _ints(g, 0, k + 1, m)
    d["smp_row"] = torch.where(_ints(g, 0, 4, m) > 0, torch.randint(0, rows, (m,), generator=g), -1)
    d["block_tables"] = torch.randint(0, 99, (B + 2, MAX_BLOCKS), generator=g, dtype=torch.int32)
    return {name: x.to(DEV) for name, x in d.items()}, _to(st, DEV)


def _to(st, device):
    for name in ("last_token", "drafts", "draft_count", "rejected", "history"):
        setattr(st, name, getattr(st, name).to(device))
    return st


def _clone(d, st):
    st2 = SimpleNamespace(**vars(st))
    for name in ("last_token", "drafts", "rejected", "history"):
        setattr(st2, name, getattr(st, name).clone())
    return {name: x.clone() for name, x in d.items()}, st2


def _torch_correct(d, st, T, B, S, history):
    """The reference: SpecStepProgram.correct's torch path on a stand-in program and slot."""
    from engine.runner.spec_step import SpecStepProgram
    program = SimpleNamespace(state=st, block_size=BS, spec_ops=None, drafter=SimpleNamespace(uses_history=history))
    return SpecStepProgram.correct(program, SimpleNamespace(dev=d), T, B, S)[0]


SHAPES = [(1, 1, 1), (4, 1, 1), (7, 3, 2), (16, 4, 4), (33, 6, 5), (12, 8, 8), (5, 5, 0), (0, 0, 0)]


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("history", [True, False], ids=["history", "no_history"])
def test_correct_equals_torch(k, history):
    clamped = False
    for seed, (T, B, S) in enumerate(SHAPES):
        d, st = _step(seed * 10 + k, T, B, S, k)
        d2, st2 = _clone(d, st)
        want = _torch_correct(d, st, T, B, S, history)
        got, drafted = so.correct(d2, st2, T, B, S, BS, history, drafted=True)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), (T, B, S)
        # SpecStepProgram.drafted's count: the host's cap and the drafter's count of the row (-1: the dummy row)
        want = torch.minimum(d["num_drafts"][:S], st.draft_count[d["smp_row"][:S]])
        assert drafted.dtype == torch.int64 and torch.equal(drafted, want), (T, B, S)
        for name in d:
            assert torch.equal(d2[name], d[name]), (name, T, B, S)
        for name in ("last_token", "drafts", "rejected"):
            assert torch.equal(getattr(st2, name), getattr(st, name)), name
        # the dummy row and column take colliding writes (padding, positions past max_model_len): scratch
        assert torch.equal(st2.history[:-1, :MML], st.history[:-1, :MML]), (T, B, S)
        clamped |= bool((d["positions"][:T] >= MML).any())
    assert clamped          # some history write went to the dummy column


def _ctx(seed, S, B, max_blocks=MAX_BLOCKS):
    from engine.attention import AttentionMetadata
    from engine.speculative.drafters.base import FeatureContext
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 99, (B + 3, max_blocks), generator=g, dtype=torch.int32)
    meta = AttentionMetadata(None, None, None, tables[:B], 4, 77)
    seq = _ints(g, 0, B, S)
    ctx = FeatureContext(next_ids=None, positions=None, meta=meta, last=None, last_seq=seq,
                         last_valid=_ints(g, 0, 4, S) > 0, kv_cap=_ints(g, 0, max_blocks + 3, B + 2)[:B] * BS)
    start = _ints(g, 0, max_blocks * BS + 3, S)
    return _ctx_to(ctx), start.to(DEV)


def _ctx_to(ctx):
    ctx.meta.block_tables = ctx.meta.block_tables.to(DEV)
    for name in ("last_seq", "last_valid", "kv_cap"):
        setattr(ctx, name, getattr(ctx, name).to(DEV))
    return ctx


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("offset", [0, 1])
def test_draft_layout_equals_torch(k, offset):
    from engine.speculative.drafters.base import draft_layout
    for seed, (S, B, max_blocks) in enumerate([(1, 1, MAX_BLOCKS), (3, 2, MAX_BLOCKS), (6, 4, 5), (16, 3, 3),
                                               (9, 9, 300)]):
        ctx, start = _ctx(seed, S, B, max_blocks)
        for mml in (MML, 7, 2000):
            want_pos, want, _ = draft_layout(ctx, start, offset, k, BS, mml)
            got_pos, got, _ = draft_layout(ctx, start, offset, k, BS, mml, kernels=True)
            assert got_pos.dtype == want_pos.dtype and torch.equal(got_pos, want_pos)
            assert len(got) == k and all(m.cu_seqlens_q is got[0].cu_seqlens_q for m in got)
            for a, b in zip(got, want):
                for name in ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
                    x, y = getattr(a, name), getattr(b, name)
                    assert x.dtype == y.dtype and x.is_contiguous() and torch.equal(x, y), (name, S, B, mml)
                assert (a.max_query_len, a.max_seq_len) == (b.max_query_len, b.max_seq_len)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32)], ids=["bf16", "fp32", "mixed"])
def test_draft_layout_gathers_each_rows_last_input(dtypes):
    """draft_gather: the layout kernel also reads row `last` of the head's queries [T, heads, dim] and features
    [T, H] (a padding row's -1 wraps to the last input, as torch indexing does); rows it cannot take (two dtypes)
    fall back to torch indexing. Either way the result is x[ctx.last], and the layout is unchanged."""
    from engine.speculative.drafters.base import draft_layout
    from engine.kernels.speculative import spec_ops
    g = torch.Generator().manual_seed(3)
    for S, T in ((1, 4), (5, 20), (3, 3)):
        ctx, start = _ctx(S, S, 2)
        ctx.last = torch.cat([_ints(g, 0, T, S - 1), torch.tensor([-1])]).to(DEV)
        q = torch.randn(T, 3, 12, generator=g).to(dtypes[0]).to(DEV)
        feature = torch.randn(T + 2, 40, generator=g).to(dtypes[1]).to(DEV)[:T]
        assert spec_ops.gathers(ctx, (q, feature)) == (dtypes[0] == dtypes[1])
        want_pos, want, _ = draft_layout(ctx, start, 0, 3, BS, MML, kernels=True)
        got_pos, got, rows = draft_layout(ctx, start, 0, 3, BS, MML, True, (q, feature), True)
        assert torch.equal(got_pos, want_pos) and all(torch.equal(a.slot_mapping, b.slot_mapping)
                                                      for a, b in zip(got, want))
        for x, y in zip(rows, (q[ctx.last], feature[ctx.last])):
            assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous() and torch.equal(x, y), S
        _, _, torch_rows = draft_layout(ctx, start, 0, 3, BS, MML, False, (q, feature), True)
        assert all(torch.equal(x, y) for x, y in zip(torch_rows, rows))


def test_draft_layout_gathers_at_a_strided_last():
    """ctx.last as a column of a wider tensor (rows S * 2 apart): the kernel reads it at unit stride, so such a
    last is gathered by torch indexing, with the same result."""
    from engine.speculative.drafters.base import draft_layout
    from engine.kernels.speculative import spec_ops
    g = torch.Generator().manual_seed(4)
    ctx, start = _ctx(5, 5, 2)
    ctx.last = _ints(g, 0, 20, 10).to(DEV).view(5, 2)[:, 1]
    q, feature = torch.randn(20, 3, 12, generator=g).to(DEV), torch.randn(20, 40, generator=g).to(DEV)
    _, _, rows = draft_layout(ctx, start, 0, 3, BS, MML, True, (q, feature), True)
    assert all(torch.equal(x, y) for x, y in zip(rows, (q[ctx.last], feature[ctx.last])))
    assert ctx.last.stride(0) == 2 and not spec_ops.gathers(ctx, (q, feature))


def test_draft_layout_of_no_rows():
    from engine.speculative.drafters.base import draft_layout
    ctx, start = _ctx(0, 0, 2)
    got_pos, got, _ = draft_layout(ctx, start, 0, 2, BS, MML, kernels=True)
    want_pos, want, _ = draft_layout(ctx, start, 0, 2, BS, MML)
    assert got_pos.shape == want_pos.shape == (2, 0) and torch.equal(got[1].cu_seqlens_q, want[1].cu_seqlens_q)


def test_refusals():
    from engine.config import EngineConfig
    d, st = _step(1, 4, 2, 2, 2)
    for bad, err in [(dict(seq_lens=d["seq_lens"].long()), TypeError), (dict(positions=d["positions"][:3]), ValueError),
                     (dict(block_tables=d["block_tables"].long()), TypeError), (dict(shift=None), TypeError)]:
        with pytest.raises(err):
            so.correct({**d, **bad}, st, 4, 2, 2, BS, True)
    with pytest.raises(ValueError, match="no 'tok_seq'"):
        so.correct({n: v for n, v in d.items() if n != "tok_seq"}, st, 4, 2, 2, BS, True)
    for args in [(4, 2, 2, 3, True), (4, 2, 2, 0, True), (-1, 2, 2, BS, True), (4, 2, 2.0, BS, True)]:
        with pytest.raises(ValueError):
            so.correct(d, st, *args)
    short = SimpleNamespace(**{**vars(st), "history": st.history[:, :-1]})
    with pytest.raises(ValueError, match="history"):
        so.correct(d, short, 4, 2, 2, BS, True)
    so.correct(d, short, 4, 2, 2, BS, False)            # no history: not read
    with pytest.raises(ValueError, match="no 'num_drafts'"):
        so.correct({n: v for n, v in d.items() if n != "num_drafts"}, st, 4, 2, 2, BS, True, drafted=True)
    with pytest.raises(ValueError, match="draft_count has 3 rows"):
        so.correct(d, SimpleNamespace(**{**vars(st), "draft_count": st.draft_count[:3]}), 4, 2, 2, BS, True)
    ctx, start = _ctx(0, 3, 2)
    for args in [(start, 0, 0, BS, MML), (start, -1, 2, BS, MML), (start, 0, 2, 6, MML), (start, 0, 2, BS, 0),
                 (start[:2], 0, 2, BS, MML), (start.int(), 0, 2, BS, MML)]:
        with pytest.raises((ValueError, TypeError)):
            so.draft_layout(ctx, *args)
    ctx.meta.block_tables = ctx.meta.block_tables[:, :0]
    with pytest.raises(ValueError, match="no columns"):
        so.draft_layout(ctx, start, 0, 2, BS, MML)
    # Triton kernels: on where the backend is Triton, off (not an error) on the torch backend
    assert not EngineConfig.of(spec_kernels=True, attention_backend="torch").use_spec_kernels()
    assert not EngineConfig.of(spec_kernels=True, attention_backend="auto", device="cpu").use_spec_kernels()
    assert EngineConfig(attention_backend="triton").use_spec_kernels()
    assert not EngineConfig.of(spec_kernels=False, attention_backend="triton").use_spec_kernels()


def _counting(monkeypatch):
    calls = {"correct": 0, "draft_layout": 0, "ngram_draft": 0}
    for name in calls:
        module = nd if name == "ngram_draft" else so
        real = getattr(module, name)
        def count(*a, name=name, real=real, **kw):
            calls[name] += 1
            return real(*a, **kw)
        monkeypatch.setattr(module, name, count)
    return calls


@pytest.mark.parametrize("speculative,depth", SPEC_DEPTHS)
def test_engine_outputs_equal_with_spec_kernels(speculative, depth, monkeypatch):
    """A whole engine (Triton backend; an untrained EAGLE head, or n-gram drafting, which writes and searches the
    history): spec_kernels on gives the drafts and greedy outputs of spec_kernels off, and its steps take the
    kernels."""
    from engine.llm_engine import LLMEngine
    calls = _counting(monkeypatch)
    prompts = [[5, 17, 99, 3, 250, 42, 7, 5, 17, 99], [300, 1, 2, 300, 1]]
    runs = {}
    for on in (False, True):
        eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                        **INTERPRETER_SETTINGS, depth=depth,
                        max_num_seqs=4, max_model_len=64, enforce_eager=True, speculative=speculative,
                        spec_head="random", num_speculative_tokens=2, spec_min_acceptance=0.0, spec_kernels=on)
        runs[on] = greedy_drafts(eng, prompts, (6, 5))
        assert_no_leak(eng)
        assert runs[on][1] and (calls["correct"] > 0) == on
    assert runs[True] == runs[False]
    assert (calls["draft_layout"] > 0) == (speculative == "eagle")
    assert (calls["ngram_draft"] > 0) == (speculative == "ngram")
