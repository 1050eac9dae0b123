"""The grammar node (engine/guided/csrc/): the native code that fills guided rows' masks without Python.

It must do exactly what the Python path (engine/guided/matching.py) does: the same tokens through the whole
engine (greedy, seeded sampling, speculation with draft masks), the same masks and caps on every row, the
same failures with the same texts, and it must really run natively (the Python path is not called)."""
import ctypes
import gc

import numpy as np
import pytest
import torch
import xgrammar as xgr

import hostfunc
from conftest import assert_no_leak
from engine.config import EngineConfig
from engine.guided import _native, native
from engine.guided.compiler import GuidedRequest
from engine.guided.masks import GrammarMasks
from engine.guided.snapshot import Snapshot
from engine.guided.matching import GuidedRow
from engine.guided.tracker import GuidedTracker
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import CPU, drive_hooked, staggered

INFO = xgr.TokenizerInfo([chr(97 + i) for i in range(26)] + ["</s>"], stop_token_ids=[26])
A, B, C, EOS = 0, 1, 2, 26


def request(compiled) -> GuidedRequest:
    g = GuidedRequest(SamplingParams(regex="a").guide, None)
    g.matcher = xgr.GrammarMatcher(compiled)
    return g


@pytest.fixture(scope="module")
def aab():
    return xgr.GrammarCompiler(INFO).compile_regex("a{2}b")


def bits(row) -> set:
    return {t for t in range(27) if (int(row[t // 32]) >> (t % 32)) & 1}


def python_runs(monkeypatch) -> list:
    calls = []
    run = GrammarMasks.run_python
    monkeypatch.setattr(GrammarMasks, "run_python", lambda self: (calls.append(1), run(self)))
    return calls


def test_a_native_row_accepts_fills_and_fails_alone(aab, monkeypatch):
    calls = python_runs(monkeypatch)
    masks = GrammarMasks(27, 4, torch.device("cpu"))
    good, rejected, out_of_range = request(aab), request(aab), request(aab)
    snap = Snapshot(0, 1, (GuidedRow(1, good, 0, (A,), -1, -1), GuidedRow(2, rejected, 0, (C,), -1, -1),
                           GuidedRow(3, out_of_range, 0, (10**6,), -1, -1)), np.array([0]))
    masks.push(snap)
    masks.run()
    assert not calls and not masks.queue and masks.last is snap and snap.consumed and snap.done.is_set()
    assert good.error is None and good.accepted == 1 and bits(masks.host_np[0][1]) == {A}
    assert rejected.error == f"the grammar rejected token {C}" and (masks.host_np[0][2] == -1).all()
    assert out_of_range.error == "the grammar rejected token 1000000"
    assert (masks.host_np[0][0] == -1).all(), "an unguided row allows everything"
    start, end = snap.times
    assert 0 <= end - start < 1.0


def test_a_raising_xgrammar_call_comes_back_as_its_error_text(aab):
    """xgrammar raises through tvm-ffi (an out-of-bounds mask row): the node gets kind and message."""
    g = request(aab)
    mask = torch.zeros(2, 1, dtype=torch.int32)
    ok, _, error = _native._fill_row_for_test(native.matchers(), g.handle, mask.data_ptr(), 2, 1, 5)
    assert not ok and error.startswith("InternalError: ") and "out of bounds" in error, error
    ok, needs_mask, error = _native._fill_row_for_test(native.matchers(), g.handle, mask.data_ptr(), 2, 1, 1)
    assert ok and needs_mask and not error and bits(mask[1]) == {A}


def test_a_row_outside_the_buffers_fails_alone(aab):
    masks = GrammarMasks(27, 2, torch.device("cpu"))
    inside, outside = request(aab), request(aab)
    masks.push(Snapshot(0, 1, (GuidedRow(0, inside, 0, (), -1, -1), GuidedRow(7, outside, 0, (), -1, -1)),
                        np.zeros(0, dtype=np.int64)))
    masks.run()
    assert inside.error is None and "outside the mask buffer" in outside.error


def test_the_node_walks_drafts_as_the_python_path_does(aab):
    """Masks, caps and matcher state after a walk, native vs Python, over every draft pattern of `aab`."""
    K, results = 3, []
    for python in (False, True):
        masks = GrammarMasks(27, 8, torch.device("cpu"), k=K, python=python)
        reqs = [request(aab) for _ in range(6)]
        drafts = [(A, A, B), (A, B, B), (C, A, A), (A, A, EOS), (A, A, B), (10**6, A, A)]
        counts = [3, 3, 3, 3, 1, 3]
        for i, (d, n) in enumerate(zip(drafts, counts)):
            masks.drafts_np[0][i, :K], masks.drafts_np[0][i, K] = d, n
        masks.push(Snapshot(0, 1, tuple(GuidedRow(i, g, 0, (), -1, -1) for i, g in enumerate(reqs)),
                            np.array([6]), step=0, width=K + 1))
        masks.run()
        results.append((masks.host_np[0][:7 * (K + 1)].copy(), masks.caps_np[0][:7].copy(),
                        [(g.error, g.accepted, g.matcher.is_terminated()) for g in reqs]))
    (nm, nc, ns), (pm, pc, ps) = results
    assert np.array_equal(nm, pm) and np.array_equal(nc, pc) and ns == ps
    assert nc.tolist() == [3, 1, 0, 2, 1, 0, K]


def test_native_and_python_nodes_give_the_same_tokens(engine, chat_prompts, monkeypatch):
    """The staggered workload (every guide kind, a sampled row, late arrivals) through both paths."""
    calls = python_runs(monkeypatch)
    got = {}
    for node in ("native", "python"):
        eng = LLMEngine(**CPU, max_num_seqs=8, grammar_node=node)
        calls.clear()
        seqs = drive_hooked(eng, staggered(chat_prompts))
        assert (len(calls) > 0) == (node == "python"), (node, len(calls))
        got[node] = [(s.output_token_ids, s.finish_reason, s.error) for s in seqs]
        assert_no_leak(eng)
    assert got["native"] == got["python"]
    assert sum(r == "stop" for _, r, _ in got["native"]) >= 3


def test_parallel_rows_give_the_same_tokens(engine, chat_prompts):
    """Rows filled on 4 threads (the node's pool from 8 rows) equal one thread's."""
    work = [(0, chat_prompts[i % 5], SamplingParams(max_tokens=16, temperature=0, regex="[a-z ]+" if i % 2 else
                                                     "[A-Z][a-z]+( [a-z]+)*")) for i in range(8)]
    outs = []
    for threads in (1, 4):
        eng = LLMEngine(**CPU, max_num_seqs=8, grammar_threads=threads)
        outs.append([s.output_token_ids for s in drive_hooked(eng, work)])
    assert outs[0] == outs[1]


def test_native_draft_masks_give_the_python_paths_tokens(guided_workload):
    """EAGLE with draft masks: the native draft nodes vs the Python draft callbacks. (Which steps speculate
    depends on when each grammar finished compiling, so acceptance counts may differ; the tokens may not.
    tests/speculative/test_spec_guided_rollback.py compares the draft masks themselves, step by step.)"""
    got = {}
    for node in ("native", "python"):
        eng = LLMEngine(**CPU, speculative="eagle", guided_draft_masks=True, grammar_node=node)
        draft = eng.runner.program.draft_masks
        assert draft.native == (node == "native")
        seqs = drive_hooked(eng, guided_workload)
        assert_no_leak(eng)
        greedy = [(s.output_token_ids, s.finish_reason) for s, w in zip(seqs, guided_workload) if w[2].temperature == 0]
        got[node] = greedy
        assert draft.callback_s > 0 and eng.timings.spec_accepted > 0
    assert got["native"] == got["python"], "the draft nodes drafted or accepted differently"


def test_a_wrapped_matcher_takes_the_python_path_for_its_steps(aab, monkeypatch):
    calls = python_runs(monkeypatch)

    class Wrapper:
        def __init__(self, m):
            self._m = m

        def __getattr__(self, name):
            return getattr(self._m, name)
    masks = GrammarMasks(27, 4, torch.device("cpu"))
    g = request(aab)
    g.matcher = Wrapper(g.matcher)
    assert g.handle == 0
    snap = Snapshot(0, 1, (GuidedRow(0, g, 0, (A,), -1, -1),), np.zeros(0, dtype=np.int64))
    masks.push(snap)
    masks.run()
    assert len(calls) == 1 and g.error is None and g.accepted == 1 and bits(masks.host_np[0][0]) == {A}


def test_registry_entries_follow_their_requests(aab, monkeypatch):
    """Snapshots name rows by registry entry: one entry a request however many steps it takes, the matcher it has
    now (a wrapper set after registering takes the Python path), gone when the request is; a bad index is refused."""
    calls = python_runs(monkeypatch)
    masks = GrammarMasks(27, 4, torch.device("cpu"))
    g, h = request(aab), request(aab)
    for step, feed in enumerate(((A,), (A,))):
        masks.push(Snapshot(step % 2, 1 - step % 2, (GuidedRow(0, g, step, feed, -1, -1),
                                                     GuidedRow(1, h, step, feed, -1, -1)), np.zeros(0, dtype=np.int64)))
        masks.run()
    assert masks.registry.live == 2 and not calls and g.accepted == h.accepted == 2
    assert bits(masks.host_np[1][0]) == bits(masks.host_np[1][1]) == {B}

    class Wrapper:
        def __init__(self, m):
            self._m = m

        def __getattr__(self, name):
            return getattr(self._m, name)
    h.matcher = Wrapper(h.matcher)
    masks.push(Snapshot(0, 1, (GuidedRow(1, h, 2, (B,), -1, -1),), np.zeros(0, dtype=np.int64)))
    masks.run()
    assert len(calls) == 1 and h.error is None and h.accepted == 3 and masks.registry.live == 2
    del g, h
    k = request(aab)        # two later steps: the earlier snapshots go, and with them the last references to g, h
    for step in (0, 1):
        masks.push(Snapshot(1 - step, step, (GuidedRow(0, k, 0, (), -1, -1),), np.zeros(0, dtype=np.int64)))
        masks.run()
    assert masks.last.rows[0].request is k
    gc.collect()
    assert masks.registry.live == 1
    with pytest.raises(IndexError, match="no registered row 5"):
        native.NativeSnapshot(masks.registry, 9, 0, 1, 0, 1, False, [0], [5], [0], [0, 0], [], [-1], [-1], [])
    with pytest.raises(ValueError, match="feed offsets"):
        native.NativeSnapshot(masks.registry, 9, 0, 1, 0, 1, False, [0], [k.entry(masks.registry)], [0], [0, 1], [],
                              [-1], [-1], [])


def test_standing_callbacks_run_from_native_code_with_the_gil():
    seen = []
    before = hostfunc.stats()["standing"]
    handle, trampoline = hostfunc.standing_callback(seen.append, 7)
    assert hostfunc.stats()["standing"] == before + 1
    try:
        call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(trampoline)    # ctypes releases the GIL around it
        call(handle)
        call(handle)
        assert seen == [7, 7]
        hostfunc._C.free_all()
        call(handle)
        assert seen == [7, 7, 7], "free_all leaves standing entries"
        assert hostfunc.stats()["standing"] == before + 1
    finally:
        hostfunc.free_hostfunc_user_data(handle)
    assert hostfunc.stats()["standing"] == before
    call(handle)
    assert seen == [7, 7, 7] and any("was freed" in e[1] for e in hostfunc.take_errors())


def test_masks_going_away_free_their_standing_entries():
    gc.collect()                        # earlier tests' masks, waiting in cycles
    before = hostfunc.stats()["standing"]
    masks = GrammarMasks(27, 2, torch.device("cpu"))
    assert hostfunc.stats()["standing"] == before + 1
    del masks
    gc.collect()
    assert hostfunc.stats()["standing"] == before and hostfunc.live_handles() == 0


def test_two_engines_take_only_their_own_callback_errors(aab, monkeypatch):
    """Each GrammarMasks tags its callbacks with an owner of its own, and a step's failure takes only the
    errors of its snapshot's owner: two engines in one process never take each other's."""
    first, second = GrammarMasks(27, 2, torch.device("cpu")), GrammarMasks(27, 2, torch.device("cpu"))
    assert first.owner != second.owner
    snaps = []
    for masks in (first, second):
        snaps.append(Snapshot(0, 1, (GuidedRow(0, request(aab), 0, (), -1, -1),), np.zeros(0, dtype=np.int64)))
        masks.push(snaps[-1])
        masks.run()
    assert [s.owner for s in snaps] == [first.owner, second.owner]
    monkeypatch.setattr(GrammarMasks, "run_python", lambda self: 1 / 0)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(hostfunc._C.trampoline_address())(first.standing[0])
    tracker = GuidedTracker(None, 27, [EOS], EngineConfig(), cuda=True)
    assert tracker.step_failure(snaps[1]) is None
    assert "ZeroDivisionError" in tracker.step_failure(snaps[0])
    assert tracker.step_failure(snaps[0]) is None, "taken once"
