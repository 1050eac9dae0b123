"""Grammar-forced drafts: at each drafting step a row's control row holds the tokens of the text its grammar
forces from there (find_jump_forward_string), all but the last and at most the draft steps, and FREE elsewhere.
The Python path (a GrammarMasks built with python=True, or before `set_vocab`) tokenizes the text with the
tokenizer. The grammar node's native draft node takes the vocabulary's longest match for a text it has not met,
and the tokenizer's tokens once the loop thread has taught it (`learn_forced`). Driven as the CPU engine drives
the callbacks (inline), one row fed a real JSON document a token at a time.
"""
import json

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine.guided.compiler import GuidedRequest
from engine.guided.draft_masks import FREE, DraftMasks
from engine.guided.masks import GrammarMasks
from engine.guided.matching import GuidedRow
from engine.guided.snapshot import Snapshot
from engine.requests.sequence import SamplingParams
from engine.sampling.sampler import apply_bitmask
from helpers import service

K = 4
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "array", "items": {"type": "object", "properties": {
        "day": {"type": "integer"}, "capitalGains": {"type": "number"}}, "required": ["day", "capitalGains"]}}},
    "required": ["name", "unit", "days"]}
# "capitalGains": the vocabulary's longest match ("Ga", "ins") is not the tokenizer's ("G", "ains")
DOC = {"name": "Lisbon", "unit": "celsius", "days": [{"day": 1, "capitalGains": 21.5}, {"day": 2, "capitalGains": 19}]}


def control_row(toks) -> list[int]:
    n = max(min(len(toks) - 1, K), 0)
    return list(toks[:n]) + [FREE] * (K - n)


@pytest.mark.parametrize("path", ["native", "python", "native-before-vocab"])
def test_control_rows_hold_the_forced_text(engine, path):
    vocab = engine.runner.vocab
    encode = lambda t: engine.tokenizer.encode(t, add_special_tokens=False)     # noqa: E731
    closing = engine.guided.vocab
    compiled = service(engine).compile_now(SamplingParams(json_schema=SCHEMA).guide)
    stream = encode(json.dumps(DOC)) + [min(engine.eos_ids)]
    g = GuidedRequest(SamplingParams(json_schema=SCHEMA).guide, None)
    g.matcher, fresh = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    masks = GrammarMasks(vocab, 2, torch.device("cpu"), k=K, python=path == "python")
    draft = DraftMasks(masks, K, 2, False, True, encode, apply_bitmask)
    if path != "native-before-vocab":
        draft.set_vocab(closing)
    forced_steps, taught, taught_differs = 0, set(), 0
    for t in range(len(stream) - 1):
        lo = g.accepted
        masks.drafts_np[t % 2][0, K] = 0
        snap = Snapshot(t % 2, 1 - t % 2, (GuidedRow(0, g, lo, tuple(stream[lo:t]), -1, t - 1),),
                        np.zeros(0, dtype=np.int64), t, K + 1)
        masks.push(snap)
        masks.run()
        draft.tokens_np[0][:] = -1
        draft.tokens_np[0][0, 0] = stream[t]            # the step's emitted token
        draft.run(0)
        assert snap.failure is None and g.error is None, (snap.failure, g.error)
        assert fresh.accept_token(stream[t])
        text = fresh.find_jump_forward_string()
        canonical = encode(text) if text else []
        if path == "native" and text and text not in taught:
            want = control_row(closing.tokens(text.encode()))
        else:
            want = control_row(canonical)
            taught_differs += path == "native" and bool(text) and want != control_row(closing.tokens(text.encode()))
        assert draft.ctl_np[0][0].tolist() == want, (t, text)
        forced_steps += want[0] != FREE
        draft.learn_forced()
        if text:
            taught.add(text)
    assert forced_steps >= 5, forced_steps
    by_native = draft.forced_drafts - draft.python_forced
    assert (by_native > 0) == (path == "native") and (draft.python_forced > 0) == (path != "native")
    assert (taught_differs > 0) == (path == "native"), taught_differs
