"""engine.kernels.speculative.spec_finish (a greedy speculative step's verification, finish and next tokens in one
kernel) against the torch code it replaces (verify.greedy_accept_ids, SpecStepProgram.finish with TokenPool.emit,
SpecStepProgram.next_tokens), bit for bit, and whole engines with Tuning.spec_kernels and
spec_finish_kernel on against off. Without CUDA the kernel runs in the Triton CPU interpreter (tests/conftest.py)."""
import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_no_leak, triton_module
from helpers import INTERPRETER_SETTINGS, SPEC_DEPTHS, greedy_drafts

sf = triton_module("speculative.spec_finish")
dr = triton_module("matmul.draft_gemv")
am = triton_module("sampling.argmax")
DEV = "cpu" if sf.interpreted() else "cuda"
MML, ROWS, VOCAB = 40, 160, 50      # max_model_len, pool rows, token ids


def _ints(g, low, high, *shape):
    return torch.randint(low, high, shape, generator=g)


def _pool(g, k):
    from engine.speculative.state import SpecState
    st = SpecState(ROWS, MML, k, torch.device("cpu"))
    st.last_token.copy_(_ints(g, 0, VOCAB, ROWS + 1))
    st.rejected.copy_(_ints(g, 0, k + 1, ROWS + 1))
    st.history.copy_(_ints(g, 0, VOCAB, *st.history.shape).int())
    return st


def _case(seed, S, K, k_max, pads, dtype=torch.int64):
    """A step of S rows (the last `pads` of them graph padding: pool row -1) verifying K drafts with a pool of
    k_max. Drafts mostly equal the target's ids, drafted counts run from -1 to K + 1, first positions reach past
    max_model_len, and the next-token sources name host ids, the next input and emitted tokens (some past the
    last one). Buffers are longer than the step and hold noise: writes past it would show."""
    g = torch.Generator().manual_seed(seed)
    st, T, w = _pool(g, k_max), S * (K + 1), K + 1
    target = _ints(g, 0, VOCAB, S, w)
    ids = _ints(g, 0, VOCAB, S, w)
    hit = _ints(g, 0, 4, S, K) > 0
    ids[:, 1:] = torch.where(hit, target[:, :K], ids[:, 1:])
    drafted = _ints(g, -1, K + 2, S)
    real = S - pads
    smp_row = torch.cat([torch.randperm(ROWS, generator=g)[:real], torch.full((pads + 2,), -1)])
    src = torch.where(_ints(g, 0, 3, T + 3) > 0, -2 - _ints(g, 0, T + 2, T + 3), _ints(g, -1, VOCAB, T + 3))
    # a padding row's first input -1: its draft row reads the buffers' last entries, as torch indexing does
    li = torch.cat([torch.arange(0, real * w, w), torch.full((pads,), -1), _ints(g, 0, T + 3, 2)])
    dev = dict(smp_row=smp_row, logits_indices=li, tok_seq=_ints(g, 0, S + 2, T + 3),
               positions=_ints(g, 0, MML + 2, T + 3), next_ids=src, temperature=torch.zeros(S + 2),
               top_k=torch.zeros(S + 2, dtype=torch.int64), top_p=torch.ones(S + 2),
               seeds=torch.zeros(S + 2, dtype=torch.int64), steps=torch.zeros(S + 2, dtype=torch.int64))
    slot = SimpleNamespace(dev={n: x.to(DEV) for n, x in dev.items()},
                           spec_out=_ints(g, -5, 99, S + 2, k_max + 2).to(DEV),
                           sampled=_ints(g, -5, 99, S + 2).to(DEV))
    for name in ("last_token", "rejected", "history"):
        setattr(st, name, getattr(st, name).to(DEV))
    return slot, st, ids.flatten().to(DEV), target.to(dtype).to(DEV), drafted.to(dtype).to(DEV)


def _clone(slot, st):
    st2 = copy.copy(st)
    for name in ("last_token", "rejected", "history"):
        setattr(st2, name, getattr(st, name).clone())
    return SimpleNamespace(dev={n: x.clone() for n, x in slot.dev.items()}, spec_out=slot.spec_out.clone(),
                           sampled=slot.sampled.clone()), st2


def _reference(slot, st, ids, target, drafted, K, history):
    """The torch path: SpecStepProgram.verify's greedy route on target ids, finish and next_tokens."""
    from engine.runner.spec_step import SpecStepProgram
    from engine.speculative.verify import greedy_accept_ids
    S = target.shape[0]
    if K:
        accepted, tokens = greedy_accept_ids(ids.view(S, K + 1)[:, 1:], target, drafted)
    else:           # a plain step (SpecStepProgram.verify): its token emitted at once, no draft verified
        tokens, accepted = target.long(), torch.zeros(S, dtype=torch.int64, device=target.device)
        st.emit(slot.dev["smp_row"][:S], tokens[:, 0])
        slot.sampled[:S] = tokens[:, 0]
    program = SimpleNamespace(state=st, drafter=SimpleNamespace(uses_history=history))
    SpecStepProgram.finish(program, slot, tokens, accepted, drafted, S, K)
    return tokens, accepted, SpecStepProgram.next_tokens(slot, ids, tokens, ids.shape[0]), _draft_rows(slot, accepted,
                                                                                                      ids.shape[0])


def _draft_rows(slot, accepted, T):
    """SpecStepProgram.draft's torch route to each row's (last, last_seq, start, last_valid)."""
    d = slot.dev
    last = d["logits_indices"][:accepted.shape[0]] + accepted
    return last, d["tok_seq"][last], d["positions"][:T][last], d["smp_row"][:accepted.shape[0]] >= 0


def _assert_same_writes(slot, st, slot2, st2, pads, where):
    """Every write equal; the dummy row (and history's dummy column) take colliding writes of several padding
    rows (and of positions past max_model_len): compared only where one row writes them."""
    assert torch.equal(slot2.spec_out, slot.spec_out) and torch.equal(slot2.sampled, slot.sampled), where
    for name in slot.dev:
        assert torch.equal(slot2.dev[name], slot.dev[name]), (name, where)
    rows = ROWS + (pads <= 1)
    for name in ("last_token", "rejected"):
        assert torch.equal(getattr(st2, name)[:rows], getattr(st, name)[:rows]), (name, where)
    assert torch.equal(st2.history[:ROWS, :MML], st.history[:ROWS, :MML]), where


CASES = [(1, 0), (1, 1), (2, 0), (3, 1), (4, 2), (6, 3), (40, 5), (150, 4)]       # (S, padding rows)


def test_the_kernel_pads_as_verification_does():
    """The kernels sit below engine/speculative/ and keep their own copy of its PAD."""
    from engine.speculative.verify import PAD
    assert sf.PAD == PAD


@pytest.mark.parametrize("K", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("history", [True, False], ids=["history", "next_ids"])
def test_greedy_finish_equals_torch(K, dtype, history):
    """K = 0: a speculating engine's plain step (its rows' draft caps 0)."""
    seen = set()
    for seed, (S, pads) in enumerate(CASES):
        for k_max in (max(K, 1), K + 2):
            slot, st, ids, target, drafted = _case(seed * 7 + K, S, K, k_max, pads, dtype)
            if not K:
                drafted = torch.zeros_like(drafted)
            slot2, st2 = _clone(slot, st)
            want = _reference(slot, st, ids, target, drafted, K, history)
            got = sf.greedy_finish(slot2, st2, ids, target, drafted, K, history, not history, not history)
            for name, x, y in zip(("tokens", "accepted"), got, want):
                assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y), (name, S, k_max)
            assert (got[2] is None) == history and (history or torch.equal(got[2], want[2])), (S, k_max)
            assert (got[3] is None) == history, (S, k_max)
            for name, x, y in zip(("last", "last_seq", "start", "last_valid"), got[3] or (), want[3]):
                assert x.dtype == y.dtype and torch.equal(x, y), (name, S, k_max)
            _assert_same_writes(slot, st, slot2, st2, pads, (S, k_max))
            seen |= set(want[1].tolist())
    assert seen == set(range(K + 1))        # every acceptance count, none to all


def _program(on, history):
    """A SpecStepProgram with what verify_finish reads."""
    from engine.runner.spec_step import SpecStepProgram
    program = SpecStepProgram.__new__(SpecStepProgram)
    program.state, program.drafter = None, SimpleNamespace(uses_history=history)
    program.spec_finish = sf if on else None
    program.draft_max_rows, program.step_io = 32, None
    return program


@pytest.mark.parametrize("history", [True, False], ids=["history", "next_ids"])
@pytest.mark.parametrize("source,K", [("logits", 3), ("target_ids", 3), ("target_ids", 0)])
def test_verify_finish_routes_greedy_steps_through_the_kernel(source, K, history, monkeypatch):
    """SpecStepProgram.verify_finish of a greedy unguided step on either the logits' argmax or the head kernels' ids
    (K = 0: a plain step of one-token rows, which verifies nothing): the same tokens and writes on and off; sampled
    steps keep the torch path."""
    from engine.runner.spec_step import SpecStepProgram
    from engine.runner.step import StepVariant
    calls = []
    real = sf.greedy_finish
    monkeypatch.setattr(sf, "greedy_finish", lambda *a: calls.append(1) or real(*a))
    S = 4
    slot, st, ids, target, drafted = _case(5, S, K, max(K, 1), 1)
    if not K:                   # what the step hands verify_finish: SpecStepProgram.drafted is None at K = 0
        slot.dev["num_drafts"], drafted = torch.zeros(S + 2, dtype=torch.int64, device=DEV), None
    logits = torch.randn(S * (K + 1), VOCAB, generator=torch.Generator().manual_seed(0)).to(DEV)
    logits[torch.arange(S * (K + 1)), target.flatten()] = 9.0
    logits, target = (logits, None) if source == "logits" else (None, target)
    runs = []
    for on in (False, True):
        s, state = _clone(slot, st)
        program = _program(on, history)
        program.state = program.pool = state
        out = program.verify_finish(s, ids, logits, target, drafted, StepVariant(False, True, False), None, S, K)
        runs.append((s, state, out))
    (s0, st0, want), (s1, st1, got) = runs
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and want[2] is None
    assert (got[2] is None) == history
    if not history:     # the draft's inputs: next tokens and the rows' (last, last_seq, start, last_valid)
        assert torch.equal(got[2][0], SpecStepProgram.next_tokens(s0, ids, want[0], ids.shape[0]))
        assert all(torch.equal(x, y) for x, y in zip(got[2][1], _draft_rows(s0, want[1], ids.shape[0])))
    _assert_same_writes(s0, st0, s1, st1, 1, source)
    assert calls == [1]


@pytest.mark.parametrize("history", [True, False], ids=["history", "next_ids"])
def test_verify_finish_routes_masked_guided_steps_through_the_kernel(history, monkeypatch):
    """A greedy guided step on the masked argmax (a position whose mask allows nothing, the grammar's own cap on
    each row's drafts, a closing row's forced token): the kernel gives the torch path's tokens and writes."""
    from engine.runner.step import StepVariant
    from engine.sampling.sampler import NO_TOKEN
    calls = []
    real = sf.greedy_finish
    monkeypatch.setattr(sf, "greedy_finish", lambda *a: calls.append(1) or real(*a))
    S, K = 5, 3
    slot, st, ids, target, drafted = _case(7, S, K, K, 1)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(S * (K + 1), VOCAB, generator=g)
    logits[torch.arange(S * (K + 1)), target.flatten().cpu()] = 9.0
    bitmask = torch.full((S * (K + 1), 2), -1, dtype=torch.int32)
    bitmask[2] = 0                          # row 0's third position allows nothing: its drafts stop before it
    bitmask[1 * (K + 1)] = 0                # row 1's first position allows nothing: it emits NO_TOKEN
    bitmask[3 * (K + 1) + 1] &= 0x0000FFFF  # row 3's second position: half its tokens
    accepts = torch.tensor([3, 2, 1, 3, 0])     # the drafts each row's grammar walk accepted
    forced = torch.full((S + 2,), -1, dtype=torch.int64)
    forced[2], drafted[2] = 11, 0           # a closing row: its token forced, no draft verified
    slot.dev["forced"] = forced.to(DEV)
    grammar = (bitmask.to(DEV), accepts.to(DEV))
    runs = []
    for on in (False, True):
        s, state = _clone(slot, st)
        program = _program(on, history)
        program.state = program.pool = state
        program.backend = SimpleNamespace(masked_argmax=am.masked_argmax)
        program.draft_masks = None
        out = program.verify_finish(s, ids, logits.to(DEV), None, drafted, StepVariant(True, True, False), grammar,
                                    S, K, masked=True)
        runs.append((s, state, out))
    (s0, st0, want), (s1, st1, got) = runs
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got[0], want[0])
    assert want[0][1, 0] == NO_TOKEN and want[0][2, 0] == 11 and want[1][0] <= 1
    _assert_same_writes(s0, st0, s1, st1, 1, "guided")
    assert calls == [1]


def test_refusals():
    slot, st, ids, target, drafted = _case(1, 3, 2, 3, 1)
    args = (slot, st, ids, target, drafted, 2, True, True, False)

    def refused(err, i, value, match=None):
        bad = list(args)
        bad[i] = value
        with pytest.raises(err, match=match):
            sf.greedy_finish(*bad)

    refused(ValueError, 5, 0)                                       # K >= 1
    refused(ValueError, 5, 4, "state.k")                            # K <= the pool's k
    refused(ValueError, 5, 2.0)
    refused(ValueError, 2, ids[:-1], "ids has")
    refused(TypeError, 2, ids.int())
    refused(TypeError, 3, target.float())
    refused(ValueError, 3, target[:, :2])
    refused(ValueError, 3, torch.cat([target, target], dim=1)[:, :3], "contiguous")
    refused(ValueError, 4, drafted[:2], "drafted has")
    refused(TypeError, 4, drafted.bool())
    refused(TypeError, 4, None)
    refused(TypeError, 6, 1)
    refused(TypeError, 7, None)
    refused(ValueError, 8, True, "history")                         # draft rows are a draft head's
    for name, value, err in [("spec_out", slot.spec_out[:, :4], ValueError), ("sampled", slot.sampled[:2], ValueError),
                             ("spec_out", slot.spec_out.int(), TypeError)]:
        refused(err, 0, SimpleNamespace(**{**vars(slot), name: value}), name)
    for name, value, err in [("smp_row", slot.dev["smp_row"][:2], ValueError), ("next_ids", None, TypeError),
                             ("logits_indices", slot.dev["logits_indices"].int(), TypeError)]:
        refused(err, 0, SimpleNamespace(**{**vars(slot), "dev": {**slot.dev, name: value}}), name)
    with pytest.raises(ValueError, match="no 'next_ids'"):
        no_next = {n: x for n, x in slot.dev.items() if n != "next_ids"}
        sf.greedy_finish(SimpleNamespace(**{**vars(slot), "dev": no_next}), st, ids, target, drafted, 2, True, True)
    short = SimpleNamespace(**{**vars(st), "history": st.history[:, :-1]})
    refused(ValueError, 1, short, "history")
    sf.greedy_finish(slot, short, ids, target, drafted, 2, False, True)      # no history: not read


# ---- whole engines ----

def _engine(speculative, depth, on, k=2, **kw):
    from engine.llm_engine import LLMEngine
    return LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                     **INTERPRETER_SETTINGS, depth=depth,
                     max_num_seqs=4, max_model_len=64, enforce_eager=True, speculative=speculative,
                     spec_head="random", num_speculative_tokens=k, spec_min_acceptance=0.0, spec_kernels=on,
                     spec_finish_kernel=on, draft_gather=on, **kw)


def _run(eng, prompts, lengths):
    """-> (outputs, drafts) of greedy requests, with no KV left behind."""
    outputs, drafts = greedy_drafts(eng, prompts, lengths)
    assert_no_leak(eng)
    assert drafts
    return outputs, drafts


def _counting(monkeypatch):
    calls = []
    real = sf.greedy_finish
    monkeypatch.setattr(sf, "greedy_finish", lambda *a: calls.append(a[3].shape) or real(*a))
    return calls


@pytest.mark.parametrize("speculative,depth", SPEC_DEPTHS)
def test_engine_outputs_equal_with_spec_kernels(speculative, depth, monkeypatch):
    """Three greedy streams (an untrained EAGLE head, or n-gram drafting, which writes the history): the kernels
    on (draft_gather too) gives the drafts and outputs of the kernels off, and its spec steps take the kernel."""
    calls = _counting(monkeypatch)
    prompts = [[5, 17, 99, 3, 250, 42, 7, 5, 17, 99], [300, 1, 2, 300, 1], [8, 9, 8, 9, 8]]
    runs = {}
    for on in (False, True):
        runs[on] = _run(_engine(speculative, depth, on), prompts, (6, 5, 7))
        assert bool(calls) == on
    assert runs[True] == runs[False]


@pytest.mark.parametrize("speculative", ["eagle", "ngram"])
def test_engine_with_the_gemv_head_and_spec_kernels(speculative, monkeypatch):
    """One stream, K = 3, the verification's head (4 rows) pinned to the GEMV: the kernel verifies the argmax
    kernels' ids, as the torch path does."""
    from engine.kernels.routes import pins
    calls, argmax = _counting(monkeypatch), []
    real = dr.linear_argmax
    monkeypatch.setattr(dr, "linear_argmax", lambda x, *a: argmax.append(x.shape[0]) or real(x, *a))
    prompt = [[5, 17, 99, 3, 250, 42, 7, 5, 17, 99]]
    gemv = pins(dict(kernel="gemv", op="head", rows=4))     # the GEMV's route, counted here
    engines = {on: _engine(speculative, 1, on, k=3, kernel_routes=gemv) for on in (False, True)}
    calls.clear()                                # the engines' route tuners time the kernels too
    argmax.clear()
    runs = {on: _run(eng, prompt, (8,)) for on, eng in engines.items()}
    assert runs[True] == runs[False]
    spec = [c for c in calls if c == (1, 4)]    # (1, 1): plain steps, their argmax from another route's kernel
    assert spec and set(calls) <= {(1, 4), (1, 1)} and set(argmax) == {4}
    assert len(argmax) == 2 * len(spec)       # each spec step of both engines: the kernel on the kernels' ids
