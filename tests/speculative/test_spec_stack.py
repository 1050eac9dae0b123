"""Speculative engines with the persistent decode stack pinned (engine/kernels/persistent/): verification steps of
one stream (1 + K tokens) and EAGLE's feature layers come from the stack, and the drafts and greedy outputs equal
those of the same engine without it. Without CUDA the stack runs in the Triton interpreter (one program)."""
import os

import pytest
import torch

from engine.kernels.persistent.stack import DecodeStack
from engine.kernels.routes import pins
from engine.llm_engine import LLMEngine
from engine.requests.sequence import SamplingParams
from helpers import record_drafts

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CALL = DecodeStack.__call__
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 5, 17, 99]]


def _run(speculative: str, stack: bool, monkeypatch):
    calls = []
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, x, pos, meta, **kw: calls.append(
        (x.shape[0], meta.max_query_len, kw.get("aux", False))) or CALL(self, x, pos, meta, **kw))
    routes = dict(kernel_routes=pins(dict(op="stack", kernel="persistent", rows=[1, 4]))) if stack else {}
    eng = LLMEngine(model="dummy:tiny", device=DEV, dtype="float32", attention_backend="triton", depth=2,
                    max_num_seqs=1, max_model_len=128, speculative=speculative, spec_head="random",
                    num_speculative_tokens=3, spec_min_acceptance=0.0, **routes)
    drafts = record_drafts(eng.runner.program.drafter)
    out = eng.generate(PROMPTS, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    return [s.output_token_ids for s in out], [d.draft_tokens.tolist() for d in drafts], calls


@pytest.mark.parametrize("speculative", ["eagle", "ngram"])
def test_spec_engine_through_the_stack_equals_the_layers(speculative, monkeypatch):
    want, want_drafts, none = _run(speculative, False, monkeypatch)
    got, got_drafts, calls = _run(speculative, True, monkeypatch)
    assert got == want and got_drafts == want_drafts and not none
    verify = [c for c in calls if c[1] > 1]
    assert verify and all(rows == 4 for rows, _, _ in verify)                  # 1 + K tokens of one sequence
    assert all(aux == (speculative == "eagle") for *_, aux in calls)            # the head's feature layers


def test_guided_rows_through_the_stack_keep_their_grammar_and_tokens(monkeypatch):
    """The stack ends at the final norm: the LM head, the grammar mask and the sampler stay the step's own, so
    guided rows (two layers with the default model's vocabulary and tokenizer) give the same tokens."""
    from helpers import CAT, WEATHER
    tokenizer = os.environ.get("SPECDEC_MODEL") or "default"
    outs, calls = {}, []
    monkeypatch.setattr(DecodeStack, "__call__", lambda self, x, *a, **kw: calls.append(x.shape[0]) or
                        CALL(self, x, *a, **kw))
    for stack in (False, True):
        routes = dict(kernel_routes=pins(dict(op="stack", kernel="persistent", rows=[1, 4]))) if stack else {}
        eng = LLMEngine(model="dummy:smollm2-tiny", tokenizer=tokenizer, device=DEV, dtype="float32",
                        attention_backend="triton", max_num_seqs=2, max_model_len=256, **routes)
        assert (eng.runner.backend.stack is not None) == stack
        prompts = [eng.apply_chat_template([{"role": "user", "content": "A cat as JSON."}]),
                   eng.apply_chat_template([{"role": "user", "content": "The weather in Paris?"}])]
        seqs = eng.generate(prompts, [SamplingParams(max_tokens=30, temperature=0.0, json_schema=schema)
                                      for schema in (CAT, WEATHER)])
        outs[stack] = [(s.output_token_ids, s.finish_reason) for s in seqs]
    assert outs[True] == outs[False] and 2 in calls
