"""Rollback is exact: the grammar callbacks of guided speculation (a step's mask callback walking its drafts,
the draft phase's callbacks accepting the step's tokens and its draft tokens) leave each matcher exactly
where a matcher fed only the committed tokens is, over hundreds of steps with random drafts, random
acceptance, steps that draft and steps that do not, and steps a row sits out (its tokens then come from the
host). The callbacks run as the CPU engine runs them (inline), on two rows of one snapshot.
"""
import json
import random

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine.guided.compiler import GuidedRequest
from engine.guided.draft_masks import DraftMasks
from engine.guided.masks import GrammarMasks
from engine.guided.snapshot import Snapshot
from engine.guided.matching import GuidedRow
from engine.sampling.sampler import apply_bitmask
from engine.requests.sequence import SamplingParams
from helpers import service

K = 3
ITEMS = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "tag": {"enum": ["red", "green", "blue"]}, "note": {"type": "string"}},
    "required": ["id", "tag", "note"]}}


class Row:
    """One request: its true token stream, what the host committed, what the last step emitted."""
    def __init__(self, engine, compiled, seed):
        rng = random.Random(seed)
        doc = [{"id": rng.randint(0, 10**6), "tag": rng.choice(["red", "green", "blue"]),
                "note": rng.choice(["ok", "two words", "x" * rng.randint(1, 9)])} for _ in range(60)]
        self.stream = engine.tokenizer.encode(json.dumps(doc), add_special_tokens=False) + [min(engine.eos_ids)]
        self.g = GuidedRequest(SamplingParams(json_schema=ITEMS).guide, None)
        self.g.matcher = xgr.GrammarMatcher(compiled)
        self.fresh = xgr.GrammarMatcher(compiled)       # fed only the committed tokens
        self.fed = 0
        self.committed, self.emitted = 0, []            # host-known tokens; the previous step's, on the "device"

    def feed_fresh(self, upto):
        for tok in self.stream[self.fed:upto]:
            assert self.fresh.accept_token(tok)
        self.fed = upto


def same_state(a, b, vocab):
    words = -(-vocab // 32)
    ma, mb = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
    if a.is_terminated() or b.is_terminated():
        return a.is_terminated() == b.is_terminated()
    a.fill_next_token_bitmask(ma)
    b.fill_next_token_bitmask(mb)
    return torch.equal(ma, mb)


def walk_reference(fresh, drafts, count, vocab):
    """(drafts the grammar accepts, the mask at each position up to there) from a fork of the fresh matcher."""
    m, words = fresh.fork(), -(-vocab // 32)
    masks = [torch.zeros(words, dtype=torch.int32)]
    m.fill_next_token_bitmask(masks[0][None])
    cap = 0
    for tok in drafts[:count]:
        if m.is_terminated() or not m.accept_token(int(tok)):
            break
        cap += 1
        masks.append(torch.full((words,), -1, dtype=torch.int32))
        if not m.is_terminated():
            m.fill_next_token_bitmask(masks[-1][None])
    return cap, masks


@pytest.mark.parametrize("python,forced", [(True, True), (False, False), (False, True)],
                         ids=["python-drafts", "native-drafts", "native-forced-drafts"])
def test_rollback_is_exact_over_hundreds_of_steps(engine, python, forced):
    """The Python draft callbacks, and the grammar node's draft nodes with and without forced drafts."""
    vocab, rng = engine.runner.vocab, random.Random(0)
    compiled = service(engine).compile_now(SamplingParams(json_schema=ITEMS).guide)
    rows = [Row(engine, compiled, seed) for seed in (1, 2)]
    masks = GrammarMasks(vocab, 4, torch.device("cpu"), k=K, python=python)
    draft = DraftMasks(masks, K, 4, True, forced, lambda t: engine.tokenizer.encode(t, add_special_tokens=False),
                       apply_bitmask)
    draft.set_vocab(engine.guided.vocab)
    steps = drafted_steps = walked = 0
    for step in range(2000):
        slot, prev = step % 2, 1 - step % 2
        live = [(i, r) for i, r in enumerate(rows) if r.committed + len(r.emitted) < len(r.stream) - 1]
        if not live:
            break
        snap_rows, sitting = [], []
        for i, r in live:
            if rng.random() < 0.08:                     # sits this step out: the host commits its tokens
                r.committed += len(r.emitted)
                r.emitted = []
                sitting.append(i)
                continue
            pend = len(r.emitted) > 0
            masks.tokens_np[prev][i] = -1
            masks.tokens_np[prev][i, :len(r.emitted)] = r.emitted
            lo = r.g.accepted
            snap_rows.append(GuidedRow(i, r.g, lo, tuple(r.stream[lo:r.committed]), i if pend else -1, step - 1))
            # drafts: the true continuation for m tokens, then random ids; the drafter proposed `count`
            t0 = r.committed + len(r.emitted)
            m, count = rng.randint(0, K), rng.randint(0, K)
            true = r.stream[t0:t0 + m]
            drafts = true + [rng.randrange(vocab) if rng.random() < 0.5 else r.stream[min(t0 + K, len(r.stream) - 1)]
                             for _ in range(K - len(true))]
            masks.drafts_np[slot][i, :K] = drafts
            masks.drafts_np[slot][i, K] = count
        if not snap_rows:
            continue
        snap = Snapshot(slot, prev, tuple(snap_rows), np.asarray(sitting, dtype=np.int64), step, K + 1)
        masks.push(snap)
        masks.run()
        steps += 1
        drafting = rng.random() < 0.6
        emitted = {}
        for gr in snap_rows:
            r = rows[gr.row]
            assert r.g.error is None, r.g.error
            t0 = r.committed + len(r.emitted)
            r.feed_fresh(t0)
            assert same_state(r.g.matcher, r.fresh, vocab), f"step {step}: the mask walk did not roll back"
            drafts, count = masks.drafts_np[slot][gr.row, :K], int(masks.drafts_np[slot][gr.row, K])
            cap, ref_masks = walk_reference(r.fresh, drafts, count, vocab)
            assert masks.caps_np[slot][gr.row] == cap
            got = masks.host_np[slot][gr.row * (K + 1):gr.row * (K + 1) + cap + 1]
            assert all(np.array_equal(got[j], ref_masks[j].numpy()) for j in range(cap + 1))
            walked += cap
            # verification: a prefix of the drafts that are the true tokens, then the target's own token
            good = 0
            while good < cap and good < K and t0 + good < len(r.stream) and drafts[good] == r.stream[t0 + good]:
                good += 1
            a = rng.randint(0, good)
            emitted[gr.row] = r.stream[t0:min(t0 + a + 1, len(r.stream))]
            r.committed, r.emitted = t0, emitted[gr.row]
        if drafting:
            drafted_steps += 1
            draft.tokens_np[0][:] = -1
            for i, toks in emitted.items():
                draft.tokens_np[0][i, :len(toks)] = toks
            draft.run(0)
            for j in range(1, K):
                for i in emitted:
                    r = rows[i]
                    nxt = r.committed + len(r.emitted) + j - 1
                    draft.tokens_np[j][i, 0] = r.stream[min(nxt, len(r.stream) - 1)] if rng.random() < 0.7 \
                        else rng.randrange(vocab)
                draft.run(j)
            assert snap.failure is None, snap.failure
            for i in emitted:
                r = rows[i]
                r.feed_fresh(r.committed + len(r.emitted))
                assert same_state(r.g.matcher, r.fresh, vocab), f"step {step}: the draft walk did not roll back"
                assert r.g.through_step == step
    assert steps > 300 and drafted_steps > 150 and walked > 100, (steps, drafted_steps, walked)
    native_forced = draft.forced_drafts - draft.python_forced
    assert (native_forced > 0, draft.python_forced > 0) == (forced and not python, forced and python)
    assert all(r.committed + len(r.emitted) >= len(r.stream) - 1 for r in rows), "a stream did not finish"
