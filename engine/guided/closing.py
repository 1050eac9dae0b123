"""Guided outputs that end valid within their token budget, and values that do not repeat forever.

The grammar keeps an output on a valid path, but nothing steers it to an end: a small model can stay inside a
string or an array until max_tokens cuts it, and the client gets half a tool call. Each guided request on
xgrammar gets a `Closer` (loop thread only). It follows the committed output with a matcher of its own (the
grammar node's matchers belong to the grammar stream's callbacks) and asks it for a closing text: a short
continuation after which the grammar is complete, found greedily from the grammar itself (its jump-forward
string where it has one, else the first byte it accepts of a list that prefers closing a string, an array or an
object). Tokenized by longest match over the vocabulary and followed by the stop token, that text is what the row
emits once its budget left reaches the closing's length plus a margin: the request ends valid, with
finish_reason "stop" and `closed_by` "budget". The budget also holds the longest closing through a branch a free
token could take (a comma before another array item): the row closes before the model can open what it could not
finish.

The repetition guard watches the committed output for one n-gram (period up to MAX_PERIOD tokens) repeated over
`limit` tokens; it then closes the value being written (the closing text up to its first closing byte: the end
of a string, array or object) and lets the model go on as the schema allows. A third firing closes the output.

Forcing: the host knows each token a closing row will emit, so the step's `forced` input carries it and the
sampler emits it in place of its own choice (the grammar's mask allows it: the text came from the grammar). The
closing text starts from committed output: a row due to close with a token in flight sits out one step first. A
closing that ends the output (the stop token last) needs no model at all: the engine commits it whole, at once,
instead of a token a step (Closer.closes_now; the tokens are the same).
Outputs that end on their own before any of this are untouched.
"""
from __future__ import annotations

import xgrammar as xgr

from engine.guided import _native
from engine.guided.closing_search import CLOSERS, ClosingVocab, branch_closings, closing_text

MAX_PERIOD = 8          # longest repeated n-gram the guard sees, in tokens
WAKE_NEVER = 1 << 62    # a closer with nothing left to decide at any output count
UNKNOWN = object()      # a Closer's first closing, not yet found
# budget left past the closing's length (or its longest branch's) when a row starts closing: room for a free token
# that goes past a branch into a longer path (the key of a longer property). Outputs that would end on their own
# within it can change.
SLACK = 4
STRUCTURE = frozenset(b'"\\{}[],:')     # bytes that can change where a value ends
JSON_KINDS = ("json_schema", "json_object", "structural_tag")   # what the repetition guard watches (tools: a tag)
REPEAT_FIRED, REPEAT_WATCH, REPEAT_WOKE = _native.REPEAT_FIRED, _native.REPEAT_WATCH, _native.REPEAT_WOKE


def repetition_scan_py(out: list, start: int, runs: list, limit: int, watch_from: int, watch: bool) -> int:
    """The repetition guard over out[start:] (the definition; Closer.committed calls its native twin). runs[p]:
    how many tokens in a row have repeated the one p before, updated in place. -> REPEAT_FIRED (some n-gram of
    period up to MAX_PERIOD now repeats over `limit` tokens; runs cleared), or REPEAT_WATCH where the last token
    leaves a repetition of at least `watch_from` tokens, with REPEAT_WOKE where any token did."""
    woke = False
    for i in range(start, len(out)):
        if out[i] not in out[max(0, i - MAX_PERIOD):i]:     # no period ends here: every run breaks
            if watch or any(runs):
                runs[:], watch = [0] * len(runs), False
            continue
        longest = 0
        for p in range(1, len(runs)):
            runs[p] = runs[p] + 1 if i >= p and out[i] == out[i - p] else 0
            if runs[p]:                                     # the last runs[p] + p tokens have period p
                longest = max(longest, runs[p] + p)
        if longest >= limit:
            runs[:] = [0] * len(runs)
            return REPEAT_FIRED
        watch = longest >= watch_from
        woke = woke or watch
    return (REPEAT_WATCH if watch else 0) | (REPEAT_WOKE if woke else 0)


class Closer:
    """One guided request's closing: its matcher over the committed output, the estimate of what closing takes
    (tokens, stop token included), and the tokens it forces from output index `start`. `margin`: budget left past
    the estimate, after the tokens in flight, at which the row enters its closing zone, where it has no token in
    flight when it is planned, so each estimate is exact; it covers the next step's 1 + K tokens and an estimate
    that grows between refreshes."""
    # slots: the native commit and schedule walks read and write these at their offsets (engine/requests/csrc)
    __slots__ = ("vocab", "budget", "guard_limit", "spec_k", "margin", "watch_from", "matcher", "fed", "text",
                 "minimum", "estimate", "estimated_at", "reserve", "branched", "forced", "start", "zone", "watch",
                 "repeating", "fired", "runs", "quiet", "wake", "closed_by")

    def __init__(self, compiled, vocab: ClosingVocab, budget: bool, guard_limit: int, spec_k: int = 0,
                 initial=UNKNOWN):
        self.vocab, self.budget, self.guard_limit = vocab, budget, guard_limit
        # A step commits up to 1 + K tokens: near a decision (its closing zone, a repetition near the guard's
        # limit) a row goes one token a step with nothing in flight, so each decision falls on the same output
        # index whatever the loop's depth or K: greedy outputs stay those of the simple loop.
        self.spec_k, self.margin, self.watch_from = spec_k, 8 + spec_k, guard_limit - 2 - 2 * spec_k
        self.matcher = xgr.GrammarMatcher(compiled)
        self.fed = 0                    # committed output tokens the matcher has accepted
        self.text = b""                 # the closing text of the last estimate
        # the shortest whole output, stop token included (None: not found); `initial`: its closing text where the
        # caller knows it (every request of a guide has the same), then `text` until the first refresh
        self.minimum = self._closing_tokens(initial)
        self.estimate, self.estimated_at = self.minimum or 0, 0
        self.reserve = 0                 # tokens of the longest closing through a branch (see branch_closings)
        self.branched = None             # the closing text `reserve` was found for
        self.forced: list[int] = []
        self.start = 0                   # output index of forced[0]
        self.zone = False                # in its closing zone
        self.watch = False               # a repetition is near the guard's limit
        self.repeating = False           # the guard fired: close the value at the next chance
        self.fired = 0                   # times the guard fired
        self.runs = [0] * (MAX_PERIOD + 1)
        self.quiet = True                # no run going and not watching: a token that repeats none of the
                                         # MAX_PERIOD before it leaves the guard as it is
        # committed outputs before which hold() has nothing to decide: it returns False and changes nothing (the
        # scheduler's native walk reads this and skips the call)
        self.wake = 0
        self.closed_by: str | None = None

    @property
    def stepwise(self) -> bool:
        """One token a step, none in flight when planned (a speculative step verifies no draft of it)."""
        return self.zone or self.watch or self.repeating or bool(self.forced)

    def closes_now(self, seq) -> bool:
        """The row's whole rest is its forced closing, stop token last, and nothing is in flight: the host can
        commit it without a step (a request that asked for logprobs steps through it, to get them)."""
        return bool(self.forced) and self.forced[-1] == self.vocab.stop and self.start == len(seq.output_token_ids) \
            and not seq.num_pending and seq.logprobs is None

    def forced_at(self, index: int) -> int:
        """The token output index `index` must be, or -1."""
        i = index - self.start
        return self.forced[i] if 0 <= i < len(self.forced) else -1

    def hold(self, seq) -> bool:
        """Before a step is planned: True when the row sits out this step (in its closing zone, or due to close a
        value, with a token in flight: the closing text must start from committed output). A closer that breaks
        turns itself off: the request runs on as it would without one."""
        if len(seq.output_token_ids) < self.wake:
            return False
        try:
            hold = self._hold(seq)
            self.wake = 0 if self.stepwise else self._next_decision(seq) if self.budget else WAKE_NEVER
            return hold
        except Exception:               # noqa: BLE001 - never the loop's failure
            self.budget, self.guard_limit, self.zone, self.repeating, self.forced = False, 0, False, False, []
            self.wake = WAKE_NEVER
            return False

    def _next_decision(self, seq) -> int:
        """The first committed-output count at which a row outside its zone refreshes its estimate or enters the
        zone (the two conditions of _hold, solved for the output count; both only grow true as it grows)."""
        # left = budget - outputs - in flight, and up to 1 + K tokens are in flight
        budget = seq.max_len - len(seq.prompt_token_ids) - 1 - self.spec_k
        zone_at = budget - self.need - self.margin
        # a refresh once out - e >= max(1, (budget - out - need - margin) // 2), e = estimated_at: x = out - e
        d = budget - self.estimated_at - self.need - self.margin
        return min(zone_at, self.estimated_at + max(1, -((1 - d) // 3)))

    def _hold(self, seq) -> bool:
        out = len(seq.output_token_ids)
        if self.forced:
            # a closing row verifies no draft: a speculative step in flight carries one of its tokens, though its
            # sequence counts 1 + K pending
            in_flight = min(seq.num_pending, 1) if self.spec_k else seq.num_pending
            if out + in_flight < self.start + len(self.forced):
                # still emitting a closing: its index is known while a plain step is in flight, not a speculative one
                return self.spec_k > 0 and seq.num_pending > 0
            self.forced = []
        # tokens it may still emit after those committed and those in flight: a row must enter its zone before its
        # in-flight tokens can carry it past the output index where the simple loop forces its closing (it forces
        # only with nothing in flight, where this is the budget left after the committed output)
        left = seq.max_len - seq.num_scheduled_tokens
        if self.budget and not self.zone:
            # estimates grow denser towards the zone: a closing would have to grow by more than a token a token
            # to be found late
            if out - self.estimated_at >= max(1, (left - self.need - self.margin) // 2):
                self._refresh(seq)
            self.zone = left <= self.need + self.margin
        if not (self.zone or self.watch or self.repeating):
            return False
        if seq.num_pending:
            return True
        if self.estimated_at != out:        # (the estimate above may have just been made from this output)
            self._refresh(seq)
        if self.text is None:
            return False
        if self.repeating:
            self._close_value(seq)
        elif self.text and left <= self.need + SLACK:
            self._force(seq, self.vocab.tokens(self.text) + [self.vocab.stop], "budget")
        return False

    def committed(self, seq, new: int) -> None:
        """After `new` tokens were appended: the repetition guard (repetition_scan_py, in native code)."""
        if not self.guard_limit or self.repeating or self.forced:
            return
        out = seq.output_token_ids
        if new == 1 and self.quiet and out[-1] not in out[-MAX_PERIOD - 1:-1]:
            return                      # (most tokens: the scan would change nothing)
        state = _native.repetition_scan(out, len(out) - new, self.runs, self.guard_limit, self.watch_from, self.watch)
        if state & REPEAT_FIRED:
            self.repeating, self.watch, self.wake = True, False, 0
            return
        self.watch = bool(state & REPEAT_WATCH)
        self.quiet = not self.watch and not any(self.runs)
        if state & REPEAT_WOKE:
            self.wake = 0

    # ---- internals ---------------------------------------------------------------------------------
    def _feed(self, seq) -> bytes:
        """Feed the matcher the committed output it has not seen; returns those bytes."""
        out = seq.output_token_ids
        text = b""
        if self.fed < len(out):
            text = self.vocab.text(out[self.fed:])
            if not self.matcher.accept_string(text):
                raise ValueError("the closing matcher rejected the committed output")
            self.fed = len(out)
        return text

    def _closing_tokens(self, text=UNKNOWN) -> int | None:
        """Tokens the closing from the matcher's state (`text`, where known) takes, stop token included; None
        (and the closer off) where the search finds no closing: the request runs as it would without it."""
        self.text = closing_text(self.matcher) if text is UNKNOWN else text
        if self.text is None:
            self.budget, self.guard_limit, self.zone, self.repeating = False, 0, False, False
            return None
        return len(self.vocab.tokens(self.text)) + 1

    @property
    def need(self) -> int:
        """Budget a row must keep to close whatever its next free token does (short of the slack)."""
        return max(self.estimate, self.reserve)

    def _refresh(self, seq) -> None:
        fed = self._feed(seq)
        self.estimate, self.estimated_at = self._closing_tokens() or 0, len(seq.output_token_ids)
        if not (self.budget and self.text):
            self.reserve = 0
        elif self.text != self.branched or STRUCTURE.intersection(fed):    # (else more of a string or a number)
            self.reserve = self._longest(branch_closings(self.matcher, self.text))
            self.branched = self.text

    def _longest(self, texts: list[bytes]) -> int:
        """Tokens of the longest-tokenized text, stop token included; 0 for none. A text takes at most a token a
        byte, so those no longer than the best so far are not tokenized."""
        best = 0
        for text in sorted(texts, key=len, reverse=True):
            if len(text) + 1 <= best:
                break
            best = max(best, len(self.vocab.tokens(text)) + 1)
        return best

    def _force(self, seq, tokens: list[int], why: str) -> None:
        self.forced, self.start, self.closed_by = tokens, len(seq.output_token_ids), why

    def _close_value(self, seq) -> None:
        """The guard fired: close the value being written (up to the closing's first closing byte), or the output
        on the third firing or where nothing is open."""
        self.repeating, self.fired = False, self.fired + 1
        ends = [self.text.index(b) for b in CLOSERS if b in self.text]
        if self.fired >= 3 or not ends:
            self._force(seq, self.vocab.tokens(self.text) + [self.vocab.stop], "repetition")
        else:
            self._force(seq, self.vocab.tokens(self.text[:min(ends) + 1]), "repetition")
