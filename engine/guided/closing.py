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
closing text starts from committed output: a row due to close with a token in flight sits out one step first.
Outputs that end on their own before any of this are untouched.
"""
from __future__ import annotations

import xgrammar as xgr

MAX_PERIOD = 8          # longest repeated n-gram the guard sees, in tokens
MAX_CLOSING = 256       # bytes a closing text may take before the search gives up
MEMO = 4096             # tokenized closings a vocabulary remembers
WAKE_NEVER = 1 << 62    # a closer with nothing left to decide at any output count
UNKNOWN = object()      # a Closer's first closing, not yet found
# budget left past the closing's length (or its longest branch's) when a row starts closing: room for a free token
# that goes past a branch into a longer path (the key of a longer property). Outputs that would end on their own
# within it can change.
SLACK = 4
CLOSERS = b'"]}'
STRUCTURE = frozenset(b'"\\{}[],:')     # bytes that can change where a value ends
# bytes that open another item where a closing would end the current one: a free token taking one grows the
# closing (a comma before another array item or a property whose required value is long)
BRANCHES = (b",", b"{", b"[", b'"')
BRANCH_POINTS = 4       # places along the closing text where a branch is tried: its start and its first closers
JSON_KINDS = ("json_schema", "json_object", "structural_tag")   # what the repetition guard watches (tools: a tag)
# bytes tried in order where the grammar forces nothing: first what closes a string, array or object, then what
# starts the shortest values, then anything printable
# (a comma before digits: after "12.0" the next required key, not more digits)
_FIRST = [b'"', b"}", b"]", b",", b"0", b"a", b"[", b"{", b"t", b"f", b"n", b"-", b":", b" ", b"1", b"A"]
CANDIDATES = tuple(_FIRST + [bytes([c]) for c in range(32, 127) if bytes([c]) not in _FIRST] + [b"\n"])


class ClosingVocab:
    """The vocabulary's bytes, for feeding a matcher committed tokens and tokenizing a closing text."""

    def __init__(self, info: xgr.TokenizerInfo):
        self.bytes = [b if isinstance(b, bytes) else b.encode() for b in info.decoded_vocab]
        special = set(info.special_token_ids) | set(info.stop_token_ids)
        self.ids = {}
        for i, b in enumerate(self.bytes):
            if b and i not in special:
                self.ids.setdefault(b, i)
        # proper prefixes of the tokens: a longest match stops where its text is none (a few lookups a token)
        self.prefixes = {b[:j] for b in self.ids for j in range(1, len(b))}
        self.stop = info.stop_token_ids[0]
        self._memo: dict[bytes, list[int]] = {}     # closings recur step after step (a string's end, say)

    def text(self, tokens) -> bytes:
        return b"".join(self.bytes[t] for t in tokens)

    def tokens(self, text: bytes) -> list[int]:
        """Longest-match tokens of `text` (every byte has a token in a byte-level vocabulary); the caller must
        not change the list."""
        out = self._memo.get(text)
        if out is None:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            out = self._memo[text] = self._tokens(text)
        return out

    def _tokens(self, text: bytes) -> list[int]:
        out, i = [], 0
        while i < len(text):
            best = size = 0
            for n in range(1, len(text) - i + 1):
                piece = text[i:i + n]
                tok = self.ids.get(piece)
                if tok is not None:
                    best, size = tok, n
                if piece not in self.prefixes:
                    break
            if not size:
                raise ValueError(f"no token spells {text[i:i + 1]!r}")
            out.append(best)
            i += size
        return out


def closing_text(matcher: xgr.GrammarMatcher, limit: int = MAX_CLOSING) -> bytes | None:
    """A continuation after which `matcher`'s grammar is complete (b"" if it is already), or None if the greedy
    search finds none within `limit` bytes. The matcher is left as it was."""
    out, steps = bytearray(), 0
    try:
        while len(out) <= limit:
            if matcher.is_completed():
                return bytes(out)
            forced = matcher.find_jump_forward_string().encode()
            if forced and matcher.accept_string(forced):
                out += forced
                steps += 1
                continue
            for byte in CANDIDATES:
                if matcher.accept_string(byte):
                    out += byte
                    steps += 1
                    break
            else:
                return None
        return None
    finally:
        if steps:
            matcher.rollback(steps)


def branch_closings(matcher: xgr.GrammarMatcher, text: bytes) -> list[bytes]:
    """Closings through a branch off `text` (the closing from `matcher`'s state): at its start each branch byte the
    grammar accepts there in place of the closing's own, after each of its first closing bytes a comma, followed by
    the closing from there. A free token can take such a branch, so the budget must hold the longest before the row
    lets the model choose. The matcher is left as it was."""
    points = [0] + [i + 1 for i, b in enumerate(text) if b in CLOSERS][:BRANCH_POINTS - 1]
    out = []
    for j in points:
        if j and not matcher.accept_string(text[:j]):
            break
        try:
            for b in BRANCHES if j == 0 else BRANCHES[:1]:     # past a closer only a comma opens another item
                if text[j:j + 1] == b or not matcher.accept_string(b):
                    continue
                rest = closing_text(matcher)
                matcher.rollback(1)
                if rest is not None:
                    out.append(text[:j] + b + rest)
        finally:
            if j:
                matcher.rollback(1)
    return out


class Closer:
    """One guided request's closing: its matcher over the committed output, the estimate of what closing takes
    (tokens, stop token included), and the tokens it forces from output index `start`. `margin`: budget left past
    the estimate at which the row enters its closing zone, where it has no token in flight when it is planned, so
    each estimate is exact."""

    def __init__(self, compiled, vocab: ClosingVocab, budget: bool, guard_limit: int, spec_k: int = 0,
                 initial=UNKNOWN):
        self.vocab, self.budget, self.guard_limit = vocab, budget, guard_limit
        # A step commits up to 1 + K tokens: near a decision (its closing zone, a repetition near the guard's
        # limit) a row goes one token a step with nothing in flight, so each decision falls on the same output
        # index whatever the loop's depth or K: greedy outputs stay those of the simple loop.
        self.spec_k, self.margin, self.watch_from = spec_k, 8 + 2 * spec_k, guard_limit - 2 - 2 * spec_k
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
        self.wake = 0                    # committed outputs before which hold() has nothing to decide
        self.closed_by: str | None = None

    @property
    def stepwise(self) -> bool:
        """One token a step, none in flight when planned (a speculative step verifies no draft of it)."""
        return self.zone or self.watch or self.repeating or bool(self.forced)

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
        budget = seq.max_len - len(seq.prompt_token_ids)        # left = budget - outputs
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
        left = seq.max_len - seq.num_tokens   # tokens it may still emit after the committed output
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
        """After `new` tokens were appended: the repetition guard."""
        if not self.guard_limit or self.repeating or self.forced:
            return
        out, runs = seq.output_token_ids, self.runs
        for i in range(len(out) - new, len(out)):
            if out[i] not in out[max(0, i - MAX_PERIOD):i]:     # no period ends here: every run breaks
                if self.watch or any(runs):
                    runs[:], self.watch = [0] * (MAX_PERIOD + 1), False
                continue
            longest = 0
            for p in range(1, MAX_PERIOD + 1):
                runs[p] = runs[p] + 1 if i >= p and out[i] == out[i - p] else 0
                if runs[p]:                                     # the last runs[p] + p tokens have period p
                    longest = max(longest, runs[p] + p)
            if longest >= self.guard_limit:
                self.repeating, self.watch, self.wake = True, False, 0
                self.runs = [0] * (MAX_PERIOD + 1)
                return
            self.watch = longest >= self.watch_from
            if self.watch:
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
            branches = branch_closings(self.matcher, self.text)
            self.reserve = max((len(self.vocab.tokens(t)) + 1 for t in branches), default=0)
            self.branched = self.text

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
