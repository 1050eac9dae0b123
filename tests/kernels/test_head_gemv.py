"""EngineConfig.head_gemv: a greedy plain step's tokens from engine.kernels.matmul.draft_gemv.linear_argmax (the LM
head + argmax on the decode GEMV, tested against torch in tests/kernels/test_verify_gemv.py), no logits. Which steps of
StepProgram take the kernels, and whole engines with the switch on against off. Without CUDA the kernels run in the
Triton CPU interpreter (tests/conftest.py)."""
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_no_leak, triton_module
from helpers import INTERPRETER_SETTINGS

dr = triton_module("matmul.draft_gemv")
DEV = "cpu" if dr.interpreted() else "cuda"
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [8, 1, 64, 64, 2], [300, 301, 302], [9, 9, 9, 9, 1, 2], [77, 6, 5, 4, 3]]


@pytest.mark.parametrize("variant,world,on,taken", [
    ((False, True, False), 1, True, True), ((True, True, False), 1, True, False),
    ((False, False, False), 1, True, False), ((False, True, True), 1, True, False),
    ((False, True, False), 2, True, False), ((False, True, False), 1, False, False)],
    ids=["greedy", "guided", "sampled", "extras", "tp2", "off"])
def test_only_greedy_unguided_steps_without_extras_skip_the_logits(variant, world, on, taken):
    from engine.runner.step import StepProgram, StepVariant
    calls = []
    backend = SimpleNamespace(linear_argmax=lambda x, w, gemv: calls.append(x.shape[0]) or
                              torch.zeros(x.shape[0]).long())
    model = SimpleNamespace(tp=SimpleNamespace(world=world), head_weight=torch.zeros(10, 8))
    program = SimpleNamespace(head_gemv=on, backend=backend, model=model)
    got = StepProgram.head_ids(program, torch.zeros(2, 8), StepVariant(*variant))
    assert (got is not None) == taken and calls == ([2] if taken else [])
    assert StepProgram.head_ids(program, None, StepVariant(*variant)) is None      # no row samples


def _engine(on: bool, depth: int, eager: bool):
    from engine.llm_engine import LLMEngine
    return LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                     **INTERPRETER_SETTINGS, depth=depth,
                     max_num_seqs=len(PROMPTS), max_model_len=64, enforce_eager=eager, head_gemv=on,
                     head_mma=False)         # the routes counted here: the GEMV's, else cuBLAS + argmax.py


def _run(eng, calls, logit_rows):
    """Each request alone (one row a step), then all prompts together (5 rows: past the kernels' 4)."""
    from engine.requests.sequence import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)]
    outs, taken, logits = [], [], []
    for params in alone:
        before, rows = len(calls), len(logit_rows)
        outs.append(eng.generate([PROMPTS[0]], params)[0])
        taken.append(len(calls) - before)
        logits.append(len(logit_rows) - rows)
    before = len(calls)
    together = eng.generate(PROMPTS, greedy)
    together_taken = len(calls) - before
    return [s.output_token_ids for s in outs + together], outs[2].logprobs, taken, logits, together_taken


# in the interpreter (~40 s a case) the pipelined loop only; both loops and the graphs on a GPU
@pytest.mark.parametrize("depth,eager", [(2, True)] + ([(1, True), (2, False)] if DEV == "cuda" else []))
def test_engine_outputs_equal_with_head_gemv(depth, eager, monkeypatch):
    """head_gemv on gives the greedy outputs of head_gemv off and its greedy one-row steps compute no logits; a
    sampled request and one with logprobs keep their logits, with the same tokens and logprobs; steps of five
    rows take cuBLAS's logits and engine/kernels/sampling/argmax.py, not the GEMV."""
    calls, real = [], dr.linear_argmax
    monkeypatch.setattr(dr, "linear_argmax", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    runs = {}
    for on in (False, True):
        eng = _engine(on, depth, eager)
        logit_rows, compute = [], eng.runner.model.compute_logits
        eng.runner.model.compute_logits = lambda h: logit_rows.append(h.shape[0]) or compute(h)
        outputs, logprobs, taken, logits, together_taken = _run(eng, calls, logit_rows)
        assert_no_leak(eng)
        if eager:                               # a CUDA graph calls neither again after its capture
            assert logits[1] and logits[2] and taken[1:] == [0, 0]
            assert (taken[0] > 0, logits[0] > 0) == (on, not on)
            assert together_taken == 0
        runs[on] = outputs, logprobs
    assert runs[True] == runs[False]
