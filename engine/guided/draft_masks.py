"""Grammar masks and grammar-forced tokens for a drafter's K draft steps (EAGLE head, draft model).

A drafting step's draft phase runs after its verification. With draft masks on, draft step j's token is the
drafter's argmax under its own mask, which a callback on the grammar stream fills; in stream order:

    draft token j - 1 (for j = 0: the step's emitted tokens) -> pinned host  |  callback j: accept it, fill
    mask j and the control row j  |  both -> device  |  record mask_ready[j]

and the compute stream waits for mask_ready[j] before draft step j picks its token. That is one host round
trip per draft step on the critical path (bench/spec/spec_guided.py measures what it costs and gains). Callback 0
accepts the step's emitted tokens for good (the next step's mask callback then skips them: `through_step`); the
draft tokens every callback accepts are rolled back by the last one, so the next step's mask callback walks
the drafts from the committed state.

Control rows (`ctl`, [rows, K] per callback): column j is >= 0 for a grammar-forced draft j (the grammar
allows one continuing text there, `find_jump_forward_string`; its canonical tokenization's first token is
drafted in place of the drafter's, since the target must take that text), -1 for the drafter's own token,
-2 to stop drafting that row (its grammar ended or failed, or allowed nothing). With draft masks off and
forced drafts on, callback 0 alone writes every column from the jump-forward string (no mask per step).

Callbacks read only the step's snapshot (the one the step's own mask node ran, before them on the same
stream) and buffers the loop thread does not touch. They are the grammar node's native draft nodes
(engine/guided/csrc/node.cpp: no Python, no GIL). The Python path below runs a step whose rows need it (a
matcher that is not xgrammar's or llguidance's own), every step of a GrammarMasks built with python=True, and
forced drafts until `set_vocab` gives the native nodes their tokenizer. The Python path tokenizes a forced text
with the tokenizer; the native nodes take the vocabulary's longest match for a text they meet for the first time,
and the tokenizer's tokens once `learn_forced` has taught them (engine/guided/csrc/forced_tokens.h). Either is a
draft the target verifies, so outputs are the same.
"""
from __future__ import annotations

import time
import weakref

import numpy as np
import torch

import hostfunc
from engine.guided import _native, closing_search, native
from engine.guided.matching import ALL, accept_each, accept_rows, failed, fill, live, rollback_each
from engine.sampling.sampler import NO_TOKEN

FREE, STOP = -1, -2
_ENCODE_CACHE = 4096


class DraftMasks:
    def __init__(self, masks, k: int, max_rows: int, draft_masks: bool, forced: bool, encode, masker,
                 steps: int | None = None):
        """k: the drafts a row holds; steps: the draft steps that pick them (a draft tree's chain, else k)."""
        self.masks, self.k, self.steps = masks, k, steps or k
        self.draft_masks, self.forced = draft_masks, forced
        self.calls = self.steps if draft_masks else int(forced)     # callbacks per drafting step
        self.encode, self.masker = encode, masker
        words, pin, device = masks.words, masks.cuda, masks.dev[0].device
        self.mask_host = [torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=pin)
                          for _ in range(self.steps)]
        self.ctl_host = [torch.full((max_rows, k), FREE, dtype=torch.int64, pin_memory=pin) for _ in range(self.steps)]
        # callback 0 reads the step's emitted tokens [rows, K + 1], callback j the draft token j - 1 [rows, 1]
        # (whole rows: a copy into a strided slice of pinned memory is not capturable)
        self.tokens_host = [torch.zeros(max_rows, k + 1 if j == 0 else 1, dtype=torch.int64, pin_memory=pin)
                            for j in range(self.steps)]
        self.mask_dev, self.ctl_dev = ([h.to(device) if pin else h for h in hs]
                                       for hs in (self.mask_host, self.ctl_host))
        self.mask_np, self.ctl_np, self.tokens_np = ([h.numpy() for h in hs] for hs in (
            self.mask_host, self.ctl_host, self.tokens_host))
        self.walked: dict[int, tuple] = {}      # request id -> (matcher, draft tokens accepted), callback thread
        self.going: list = []                   # rows still drafting (callback thread)
        self.encoded: dict[str, list[int]] = {}
        self.python_forced = 0                  # forced tokens the Python path drafted (callback thread writes)
        self._forced_base = 0
        self.forced_tokens = None               # the native draft nodes' (set_vocab)
        self.python_s = 0.0                     # host time inside the Python draft callbacks (callback thread)
        self._native_base = 0.0
        self._pick = None                       # per drafting step, device tensors of the one being enqueued
        self.native = not masks.python
        ref = weakref.ref(self)
        self.callbacks = [lambda j=j: _call(ref, j) for j in range(self.steps)]
        if self.native:
            ptrs = lambda hs: [h.data_ptr() for h in hs]        # noqa: E731
            masks.node.set_draft(ptrs(self.mask_host), ptrs(self.ctl_host), ptrs(self.tokens_host), max_rows, words,
                                 self.calls, draft_masks, forced)
            with hostfunc.owner_scope(masks.owner):
                masks.attach_draft_python([hostfunc.standing_callback(cb)[0] for cb in self.callbacks])
        if pin:
            self.token_ready = [torch.cuda.Event() for _ in range(self.steps)]
            self.mask_ready = [torch.cuda.Event() for _ in range(self.steps)]

    def set_vocab(self, vocab) -> None:
        """Forced drafts in the native draft nodes from now on, tokenized by `vocab` (a closing_search.ClosingVocab)
        until `learn_forced` has taught them the tokenizer's tokens. Call it while no step runs."""
        if self.native and self.forced:
            self.forced_tokens = _native.ForcedTokens(vocab.native, _ENCODE_CACHE)
            self.masks.node.set_forced(closing_search.native_search(), self.forced_tokens)

    def learn_forced(self) -> None:
        """Loop thread, while a step runs: the tokenizer's tokens of the forced texts the native draft nodes met
        since the last call (they drafted them by longest match)."""
        if self.forced_tokens is None:
            return
        for text in self.forced_tokens.take():
            try:
                self.forced_tokens.teach(text, self.encode(text.decode()))
            except UnicodeDecodeError:      # (a forced text is whole characters; the longest match stays)
                continue

    @property
    def forced_drafts(self) -> int:
        """Forced tokens drafted, by either path (since it was last set; read after runs)."""
        return self.python_forced + (self.masks.node.forced_drafts - self._forced_base if self.native else 0)

    @forced_drafts.setter
    def forced_drafts(self, count: int) -> None:
        self.python_forced, self._forced_base = count, self.masks.node.forced_drafts

    @property
    def callback_s(self) -> float:
        """Host time inside the draft callbacks, native and Python (since it was last set)."""
        return self.python_s + (self.masks.node.draft_seconds - self._native_base if self.native else 0.0)

    @callback_s.setter
    def callback_s(self, seconds: float) -> None:
        self.python_s, self._native_base = seconds, self.masks.node.draft_seconds

    # ---- device side (enqueued by the drafter, inside the step) ---------------------------------
    def begin(self, emitted: torch.Tensor, compute_stream) -> None:
        """Start a drafting step; emitted: [S, K' + 1] the step's emitted tokens (PAD after them), K' = K in a
        speculative step and 0 in a plain one."""
        S = emitted.shape[0]
        emitted = torch.nn.functional.pad(emitted, (0, self.k + 1 - emitted.shape[1]), value=NO_TOKEN)   # = PAD
        self._pick = dict(stream=compute_stream, source=emitted, S=S,
                          stop=torch.zeros(S, dtype=torch.bool, device=emitted.device),
                          count=torch.zeros(S, dtype=torch.int64, device=emitted.device))

    def pick(self, j: int, logits: torch.Tensor) -> torch.Tensor:
        """Draft token j [S] from the drafter's logits [S, V] (modified in place by the mask)."""
        return self.top(j, logits, 1)[:, 0]

    def top(self, j: int, logits: torch.Tensor, n: int) -> torch.Tensor:
        """Draft token j and the next n - 1 candidates under the mask [S, n] (a draft tree's leaves at depth j + 1;
        a rank past the tokens the mask allows repeats token j, which the grammar's walk of the tree skips)."""
        p, S = self._pick, self._pick["S"]
        c = min(j, self.calls - 1)
        if j < self.calls:
            self._run(j, p["source"], S, p["stream"])
        if self.draft_masks:
            satisfiable = self.masker(logits, self.mask_dev[j][:S])
        else:
            satisfiable = torch.ones_like(p["stop"])
        ctl = self.ctl_dev[c][:S, j]
        token = torch.where(ctl >= 0, ctl, logits.argmax(-1))
        p["stop"] = p["stop"] | (ctl == STOP) | ~satisfiable
        p["count"] = p["count"] + (~p["stop"]).long()
        p["source"] = token
        if n == 1:
            return token[:, None]
        ranked = logits.topk(n, dim=-1)
        leaves = torch.where(ranked.values[:, 1:] > float("-inf"), ranked.indices[:, 1:], token[:, None])
        return torch.cat([token[:, None], leaves], dim=1)

    def num_drafts(self) -> torch.Tensor:
        return self._pick["count"]

    def _run(self, j: int, source: torch.Tensor, S: int, compute_stream) -> None:
        tp = self.masks.tp
        if tp.decides:
            self._fill(j, source, S, compute_stream)
        if self.draft_masks:                # rank 0's, for every rank (tensor parallelism)
            tp.broadcast(self.mask_dev[j][:S])
        tp.broadcast(self.ctl_dev[j][:S])

    def _fill(self, j: int, source: torch.Tensor, S: int, compute_stream) -> None:
        src = source if source.dim() == 2 else source[:, None]
        if not self.masks.cuda:
            self.tokens_host[j][:S] = src
            self.run(j)
            return
        self.token_ready[j].record(compute_stream)
        grammar = self.masks.grammar_stream
        grammar.wait_event(self.token_ready[j])
        with torch.cuda.stream(grammar):
            self.tokens_host[j][:S].copy_(src, non_blocking=True)
            if self.native:
                hostfunc.launch_native(grammar, native.DRAFT_NODE, self.masks.node.draft_address(j))
            else:
                with hostfunc.owner_scope(self.masks.owner):     # captured: the graph's scope keeps the handle
                    hostfunc.launch_hostfunc(grammar, self.callbacks[j])
            if self.draft_masks:
                self.mask_dev[j][:S].copy_(self.mask_host[j][:S], non_blocking=True)
            self.ctl_dev[j][:S].copy_(self.ctl_host[j][:S], non_blocking=True)
            self.mask_ready[j].record(grammar)
        compute_stream.wait_event(self.mask_ready[j])

    # ---- callbacks (driver thread on CUDA) ------------------------------------------------------
    def run(self, j: int) -> None:
        """Draft callback j here (the CPU's path; tests)."""
        if self.native:
            self.masks.node.run_draft(j)
        else:
            self.run_python(j)

    def run_python(self, j: int) -> None:
        snap, start = self.masks.last, time.perf_counter()
        try:
            self._step(snap, j)
        except Exception as exc:            # noqa: BLE001 - every guided row of the step fails with it
            snap.failure = f"{type(exc).__name__}: {exc}"
        finally:
            if j == self.calls - 1:
                self._roll_back()
            self.python_s += time.perf_counter() - start

    def _step(self, snap, j: int) -> None:
        ctl, mask, tokens = self.ctl_np[j], self.mask_np[j], self.tokens_np[j]
        if len(snap.unguided):
            ctl[snap.unguided] = FREE
            mask[snap.unguided] = ALL
        if j == 0:
            self.walked = {}
            accept_rows(self.masks.batch, snap.rows, tokens, step=snap.step)
            self.going = [r for r in snap.rows if live(r.request)]
        else:
            self.going = self._accept_drafts(self.going, tokens[:, 0])
        going = {id(r) for r in self.going}
        for r in snap.rows:
            if id(r) not in going:
                ctl[r.row] = STOP
                mask[r.row] = ALL
        if self.draft_masks:
            fill(self.masks.batch, self.mask_host[j], [r.request for r in self.going], [r.row for r in self.going])
        for r in self.going:
            ctl[r.row] = FREE
            if self.forced and r.request.error is None:
                try:
                    self._force(r, j, ctl[r.row], mask[r.row])
                except Exception as exc:    # noqa: BLE001 - this request alone fails
                    r.request.error = failed(exc)

    def _accept_drafts(self, rows, drafts: np.ndarray) -> list:
        """Draft token j - 1 of each row still drafting (picked under its mask, so normally accepted)."""
        if not rows:
            return []
        tokens = [int(drafts[r.row]) for r in rows]
        try:
            ok = accept_each(self.masks.batch, [r.request.matcher for r in rows], tokens)
        except Exception:               # noqa: BLE001 - find the row(s) that fail, one by one
            ok = [_accept_one(r.request, tok) for r, tok in zip(rows, tokens)]
        going = []
        for r, good in zip(rows, ok):
            if good:
                m, n = self.walked.get(id(r.request), (r.request.matcher, 0))
                self.walked[id(r.request)] = (m, n + 1)
                if not r.request.matcher.is_terminated():
                    going.append(r)
        return going

    def _force(self, r, j: int, ctl_row: np.ndarray, mask_row: np.ndarray) -> None:
        """Draft the jump-forward text's tokens (all but its last, which may merge with what follows it)."""
        text = r.request.matcher.find_jump_forward_string()
        if not text:
            return
        toks = self.encoded.get(text)
        if toks is None:
            if len(self.encoded) >= _ENCODE_CACHE:
                self.encoded.clear()
            toks = self.encoded[text] = self.encode(text)
        n = min(len(toks) - 1, 1 if self.draft_masks else self.steps - j)
        if n <= 0 or (self.draft_masks and not (mask_row[toks[0] >> 5] >> (toks[0] & 31)) & 1):
            return
        ctl_row[j:j + n] = toks[:n]
        self.python_forced += n

    def _roll_back(self) -> None:
        back = [(m, n) for m, n in self.walked.values() if n]
        self.walked = {}
        if back:
            rollback_each(self.masks.batch, back)


def _accept_one(g, token: int) -> bool:
    try:
        return g.matcher.accept_token(token)
    except Exception as exc:            # noqa: BLE001 - this request alone fails
        g.error = failed(exc)
        return False


def _call(ref, j: int) -> None:
    draft = ref()
    if draft is not None:
        draft.run_python(j)
