"""A greedy plain step's tokens from the LM head's argmax kernels, no logits: engine.kernels.matmul.draft_gemv.
linear_argmax (the LM head + argmax on the decode GEMV, tested against torch in
tests/kernels/test_verify_head_argmax.py) where the route table pins "gemv" for the "head" op, else cuBLAS's logits
and engine/kernels/sampling/argmax.py. Which steps of StepProgram take the kernels, and whole engines with the GEMV
pinned against the reference (cuBLAS, logits). Without CUDA the kernels run in the Triton CPU interpreter
(tests/conftest.py)."""
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_no_leak, triton_module
from engine.kernels.routes import pins
from helpers import INTERPRETER_SETTINGS

dr = triton_module("matmul.draft_gemv")
DEV = "cpu" if dr.interpreted() else "cuda"
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [8, 1, 64, 64, 2], [300, 301, 302], [9, 9, 9, 9, 1, 2], [77, 6, 5, 4, 3]]


@pytest.mark.parametrize("variant,world,taken", [
    ((False, True, False), 1, True), ((True, True, False), 1, False), ((False, False, False), 1, False),
    ((False, True, True), 1, False), ((False, True, False), 2, False)],
    ids=["greedy", "guided", "sampled", "extras", "tp2"])
def test_only_greedy_unguided_steps_without_extras_skip_the_logits(variant, world, taken):
    """A backend without a head kernel for the call (the reference table, the torch backend) returns None: the
    step computes its logits."""
    from engine.runner.step import StepProgram, StepVariant
    calls = []
    model = SimpleNamespace(tp=SimpleNamespace(world=world), head_weight=torch.zeros(10, 8))
    for kernels in (True, False):
        backend = SimpleNamespace(linear_argmax=lambda x, w: calls.append(x.shape[0]) or (
            torch.zeros(x.shape[0]).long() if kernels else None))
        program = SimpleNamespace(backend=backend, model=model)
        got = StepProgram.head_ids(program, torch.zeros(2, 8), StepVariant(*variant))
        assert (got is not None) == (taken and kernels)
        assert StepProgram.head_ids(program, None, StepVariant(*variant)) is None      # no row samples
    assert calls == ([2, 2] if taken else [])


def _engine(routes: dict, depth: int, eager: bool):
    from engine.llm_engine import LLMEngine
    return LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton",
                     **INTERPRETER_SETTINGS, depth=depth,
                     max_num_seqs=len(PROMPTS), max_model_len=64, enforce_eager=eager, **routes)


def _run(eng, calls, logit_rows):
    """Each request alone (one row a step), then all prompts together (5 rows: past the GEMV's pin)."""
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
    before, rows = len(calls), len(logit_rows)
    together = eng.generate(PROMPTS, greedy)
    together_taken, together_logits = len(calls) - before, len(logit_rows) - rows
    return [s.output_token_ids for s in outs + together], outs[2].logprobs, taken, logits, (together_taken,
                                                                                              together_logits)


# in the interpreter (~40 s a case) the pipelined loop only; both loops and the graphs on a GPU
@pytest.mark.parametrize("depth,eager", [(2, True)] + ([(1, True), (2, False)] if DEV == "cuda" else []))
def test_engine_outputs_equal_with_the_gemv_head(depth, eager, monkeypatch):
    """The GEMV pinned for the LM head to 4 rows gives the reference's greedy outputs (cuBLAS, every step's
    logits), and its greedy one-row steps compute no logits; a sampled request and one with logprobs keep their
    logits, with the same tokens and logprobs; steps of five rows take cuBLAS's logits and engine/kernels/
    sampling/argmax.py, with no float32 logits, not the GEMV."""
    calls, real = [], dr.linear_argmax
    monkeypatch.setattr(dr, "linear_argmax", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    runs = {}
    for on in (False, True):
        # the other matmuls on cuBLAS too: on a GPU the tuner's routes would round the logprobs differently
        gemv_head = pins(dict(kernel="cublas"), dict(kernel="gemv", op="head", rows=[1, 4]))
        routes = dict(kernel_routes=gemv_head) if on else dict(kernels="reference")
        eng = _engine(routes, depth, eager)
        logit_rows, compute = [], eng.runner.model.compute_logits
        eng.runner.model.compute_logits = lambda h: logit_rows.append(h.shape[0]) or compute(h)
        outputs, logprobs, taken, logits, together = _run(eng, calls, logit_rows)
        assert_no_leak(eng)
        if eager:                               # a CUDA graph calls neither again after its capture
            assert logits[1] and logits[2] and taken[1:] == [0, 0]
            assert (taken[0] > 0, logits[0] > 0) == (on, not on)
            assert together[0] == 0 and (together[1] > 0) == (not on)
        runs[on] = outputs, logprobs
    assert runs[True] == runs[False]
