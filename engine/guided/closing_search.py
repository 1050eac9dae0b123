"""The closing search: a short continuation after which a guided output's grammar is complete, the closings
through the branches a free token could take off it, and their tokens (engine/guided/closing.py uses them).

The search is greedy over the grammar itself: its jump-forward string where it has one, else the first byte it
accepts of a list that prefers closing a string, an array or an object. xgrammar's own matchers walk in native
code (engine/guided/csrc/closing.cpp, the same walk through tvm-ffi calls); the Python walk here is its reference
and runs any other matcher.
"""
from __future__ import annotations

import functools

import xgrammar as xgr

from engine.guided import _native, native

MAX_CLOSING = 256       # bytes a closing text may take before the search gives up
MEMO = 4096             # tokenized closings a vocabulary remembers
CLOSERS = b'"]}'
# bytes that open another item where a closing would end the current one: a free token taking one grows the
# closing (a comma before another array item or a property whose required value is long)
BRANCHES = (b",", b"{", b"[", b'"')
BRANCH_POINTS = 4       # places along the closing text where a branch is tried: its start and its first closers
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
        self.stop = info.stop_token_ids[0]
        self._memo: dict[bytes, list[int]] = {}     # closings recur step after step (a string's end, say)
        self.native = _native.ClosingVocab(list(self.ids), list(self.ids.values()))     # python_tokens in C++

    def text(self, tokens) -> bytes:
        return b"".join(map(self.bytes.__getitem__, tokens))      # (no generator frame: a closer feeds each step)

    def tokens(self, text: bytes) -> list[int]:
        """Longest-match tokens of `text` (every byte has a token in a byte-level vocabulary); the caller must
        not change the list."""
        out = self._memo.get(text)
        if out is None:
            if len(self._memo) >= MEMO:
                self._memo.clear()
            out = self._memo[text] = self.native.tokens(text)
        return out

    @functools.cached_property
    def prefixes(self) -> set[bytes]:
        """Proper prefixes of the tokens: a longest match stops where its text is none (a few lookups a token)."""
        return {b[:j] for b in self.ids for j in range(1, len(b))}

    def python_tokens(self, text: bytes) -> list[int]:
        """`tokens` one dictionary lookup at a time (the reference of the native tokenizer)."""
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


@functools.cache
def native_search():
    """The native search with this module's constants, bound once per process (not rehashed at every call)."""
    return native.closing_search(CANDIDATES, BRANCHES, CLOSERS, BRANCH_POINTS)


def closing_text(matcher: xgr.GrammarMatcher, limit: int = MAX_CLOSING) -> bytes | None:
    """A continuation after which `matcher`'s grammar is complete (b"" if it is already), or None if the greedy
    search finds none within `limit` bytes. The matcher is left as it was. xgrammar's own matchers walk in native
    code (engine/guided/csrc/closing.cpp), anything else here (the same walk)."""
    handle = native.handle(matcher)
    if handle:
        return _native.closing_text(native_search(), handle, limit)
    return python_closing_text(matcher, limit)


def python_closing_text(matcher: xgr.GrammarMatcher, limit: int = MAX_CLOSING) -> bytes | None:
    """closing_text's walk, one matcher call at a time (the reference of the native one)."""
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
    handle = native.handle(matcher)
    if handle:
        return _native.branch_closings(native_search(), handle, text, MAX_CLOSING)
    return python_branch_closings(matcher, text)


def python_branch_closings(matcher: xgr.GrammarMatcher, text: bytes) -> list[bytes]:
    """branch_closings one matcher call at a time (the reference of the native one)."""
    points = [0] + [i + 1 for i, b in enumerate(text) if b in CLOSERS][:BRANCH_POINTS - 1]
    out = []
    for j in points:
        if j and not matcher.accept_string(text[:j]):
            break
        try:
            for b in BRANCHES if j == 0 else BRANCHES[:1]:     # past a closer only a comma opens another item
                if text[j:j + 1] == b or not matcher.accept_string(b):
                    continue
                rest = python_closing_text(matcher)
                matcher.rollback(1)
                if rest is not None:
                    out.append(text[:j] + b + rest)
        finally:
            if j:
                matcher.rollback(1)
    return out
