"""Grammar-forced drafts: at each drafting step a row's control row holds the tokens of the text its grammar
forces from there (find_jump_forward_string), all but the last and at most the draft steps, and FREE elsewhere.
The grammar node's native draft node tokenizes the text by longest match over the vocabulary; the Python path
(a GrammarMasks built with python=True, or before `set_vocab`) with the tokenizer. Driven as the CPU engine
drives the callbacks (inline), one row fed a real JSON document a token at a time.
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
        "day": {"type": "integer"}, "high": {"type": "number"}}, "required": ["day", "high"]}}},
    "required": ["name", "unit", "days"]}
DOC = {"name": "Lisbon", "unit": "celsius", "days": [{"day": 1, "high": 21.5}, {"day": 2, "high": 19}]}


def expected_ctl(fresh, tokenize) -> list[int]:
    text = fresh.find_jump_forward_string()
    toks = tokenize(text) if text else []
    n = max(min(len(toks) - 1, K), 0)
    return list(toks[:n]) + [FREE] * (K - n)


@pytest.mark.parametrize("path", ["native", "python", "native-before-vocab"])
def test_control_rows_hold_the_forced_text(engine, path):
    vocab = engine.runner.vocab
    encode = lambda t: engine.tokenizer.encode(t, add_special_tokens=False)     # noqa: E731
    closing = engine.guided.vocab
    tokenize = (lambda t: closing.tokens(t.encode())) if path == "native" else encode     # noqa: E731
    compiled = service(engine).compile_now(SamplingParams(json_schema=SCHEMA).guide)
    stream = encode(json.dumps(DOC)) + [min(engine.eos_ids)]
    g = GuidedRequest(SamplingParams(json_schema=SCHEMA).guide, None)
    g.matcher, fresh = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    masks = GrammarMasks(vocab, 2, torch.device("cpu"), k=K, python=path == "python")
    draft = DraftMasks(masks, K, 2, False, True, encode, apply_bitmask)
    if path != "native-before-vocab":
        draft.set_vocab(closing)
    forced_steps = 0
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
        want = expected_ctl(fresh, tokenize)
        assert draft.ctl_np[0][0].tolist() == want, (t, fresh.find_jump_forward_string())
        forced_steps += want[0] != FREE
    assert forced_steps >= 5, forced_steps
    by_native = draft.forced_drafts - draft.python_forced
    assert (by_native > 0) == (path == "native") and (draft.python_forced > 0) == (path != "native")
