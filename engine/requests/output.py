"""The engine's one output path: commit sampled tokens, detect stops, detokenize incrementally, stream text.

A commit costs O(new tokens), not O(output length): each token is decoded in a window of a few tokens
(IncrementalDetokenizer) and stop strings are matched by an automaton fed only the new text
(engine/requests/stop_strings.py). Streamed text holds back what may still turn into a stop string, so a stop string (or
a prefix of one that ends up cut) is never released.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

from engine.requests.stop_strings import stop_strings

REPLACEMENT = "\ufffd"      # what decode yields for bytes that are not (yet) a whole UTF-8 character
MAX_PENDING = 16            # tokens a window may hold undecodable before it is forced on (bounds the cost)
PROMPT_CONTEXT = 4          # prompt tokens decoded before the first output token (leading-space rules)
_TRIM = 256                 # drop window ids this far behind its start


class RequestOutput(NamedTuple):
    """Immutable, and cheap to build: one is made per request per step."""
    request_id: int
    new_token_ids: tuple[int, ...]              # tokens this commit appended (a copy)
    new_text: str                               # text released by this commit; a stop string is never released
    finished: bool
    finish_reason: str | None = None            # "stop" | "length" | "abort" | "error"
    error: str | None = None                    # message when finish_reason == "error"
    token_ids: tuple[int, ...] | None = None    # whole output, only on the final output
    text: str | None = None                     # whole output text, only on the final output
    spec: dict | None = None                    # speculation statistics (speculative/state.py), final output only
    logprobs: tuple | None = None               # an engine.sampling.logprobs.Entry per new token (params.logprobs set):
                                                # (its logprob, [(token id, logprob), ...] best first)
    cached_tokens: int = 0                      # prompt tokens found in the prefix cache, final output only
    prompt_logprobs: list | None = None         # engine/sampling/prompt_logprobs.py entries, final output only
    closed_by: str | None = None                # a guided output the engine closed: "budget" or "repetition"
                                                # (engine/guided/closing.py), final output only


# text that tokenization-space cleanup would change (" ." -> ".", " 's" -> "'s", ...)
_CLEANUP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j 'll"


@functools.lru_cache(maxsize=16)
def _decoder(tokenizer, skip_special_tokens: bool):
    """tokenizer.decode, or the Rust decode it wraps (a seventh of the call's cost: this runs for every streamed
    token) where the two agree: a fast tokenizer whose decode does no space cleanup. Whether it does depends
    on the tokenizer's settings and the transformers version, so it is asked, on a text cleanup would change."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slow = functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    if backend is None:
        return slow
    fast = functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    probe = tokenizer.encode(_CLEANUP_PROBE, add_special_tokens=False)
    return fast if fast(probe) == slow(probe) else slow


def _special_ids(tokenizer) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return frozenset(ids)


class IncrementalDetokenizer:
    """Text of a token stream, O(1) tokens decoded per token.

    The window ids[prefix:] is decoded; ids[prefix:read] is context whose text was already returned (it keeps
    SentencePiece leading spaces and byte-level merges right), ids[read:] is pending. A trailing run of U+FFFD
    may be a character whose bytes are still arriving, so it is held until a later token completes it (or
    flush). Concatenating every add() plus flush() equals tokenizer.decode(tokens) for the same
    skip_special_tokens, except when MAX_PENDING tokens in a row end inside broken UTF-8: the window is then
    forced on and the replacement chars at that point are taken as final.

    With prompt_ids, its last tokens are decoded as context: the text is then what the tokens add to the
    prompt's text (for SentencePiece: the first token keeps its leading space)."""

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = False):
        if tokenizer is None:
            raise ValueError("IncrementalDetokenizer needs a tokenizer")
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._skip = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        # special tokens never enter the window: decoded first in it, they would shift the leading-space rules
        self._ids = [int(t) for t in list(prompt_ids)[-PROMPT_CONTEXT:] if t not in self._skip]
        self._prefix, self._read = 0, len(self._ids)
        self._prefix_len: int | None = None     # len(decode(ids[prefix:read])), decoded when first needed
        self._sent = 0          # chars of the pending tokens' text already returned
        self._tail = ""         # their text not returned yet (held replacement chars)

    def add(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        ids = self._ids
        ids.append(token_id)
        if self._prefix_len is None:        # once per window: pending tokens do not decode the context again
            self._prefix_len = len(self._decode(ids[self._prefix:self._read])) if self._read > self._prefix else 0
        text = self._decode(ids[self._prefix:])
        start = self._prefix_len + self._sent
        stable = len(text.rstrip(REPLACEMENT))
        if stable == len(text) or len(ids) - self._read >= MAX_PENDING:
            self._prefix, self._read, self._prefix_len = self._read, len(ids), None
            self._sent, self._tail = 0, ""
            self._trim()
            return text[start:]
        self._sent = max(self._sent, stable - self._prefix_len)
        self._tail = text[self._prefix_len + self._sent:]
        return text[start:stable]

    def flush(self) -> str:
        """Text held back at the end (an incomplete character, decoded as-is); the window starts afresh."""
        tail = self._tail
        self._prefix = self._read = len(self._ids)
        self._prefix_len, self._sent, self._tail = 0, 0, ""
        return tail

    def _trim(self) -> None:
        if self._prefix >= _TRIM:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0


class OutputState:
    """Per-request output state (seq.out). Lazy (no stop strings, text not streamed): no per-token decode;
    the text is decoded once when the request ends, and the final output releases all of it."""
    __slots__ = ("detok", "stops", "stop_state", "sent", "num_new", "reason", "cut", "lazy", "token_stop", "keep_stop")

    def __init__(self, detok: IncrementalDetokenizer | None, stops: tuple[str, ...], lazy: bool = False,
                 keep_stop: bool = False):
        self.detok, self.keep_stop = detok, keep_stop     # keep_stop: the text ends after the stop string
        self.lazy = lazy and not stops and detok is not None
        self.token_stop = False     # the last token ended the request by itself (EOS, stop id): not text
        # without a tokenizer there is no text to stop on
        self.stops = stop_strings(stops) if stops and detok is not None else None
        self.stop_state = 0         # the automaton's state after seq.text
        self.sent = 0               # chars of seq.text released in outputs
        self.num_new = 0            # tokens the last commit appended
        self.reason: str | None = None
        self.cut = False            # seq.text was cut at a stop string: later text is dropped

    @property
    def finished(self) -> bool:
        return self.reason is not None


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(t) for t in eos_ids)

    def start(self, seq, stream: bool = True, detokenize: bool = True) -> None:
        """Create seq.out when the request is added. Its text is tokenizer.decode(output ids): the prompt is no
        context (the engine's final text has always been the outputs' decode alone). stream=False: nobody
        reads text before the end, so a request without stop strings decodes nothing per token.
        detokenize=False: no text at all (the caller decodes the ids itself)."""
        if not detokenize and seq.params.stop:
            raise ValueError("stop strings need the engine's text: they cannot go with detokenize=False")
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None and detokenize else None
        seq.out = OutputState(detok, tuple(seq.params.stop), lazy=not stream,
                              keep_stop=seq.params.include_stop_str_in_output)

    def _state(self, seq) -> OutputState:
        st = getattr(seq, "out", None)
        if st is None:
            self.start(seq)
            st = seq.out
        return st

    def commit(self, seq, tokens) -> str | None:
        """Append `tokens` (one, or several for speculative decoding) to seq.output_token_ids in order, up to
        the first that ends the request. Returns the finish reason or None. Does not call the scheduler."""
        st = getattr(seq, "out", None) or self._state(seq)     # (the call only for a request's first commit)
        if st.reason is not None:
            raise RuntimeError(f"request {seq.seq_id} already finished ({st.reason}); nothing more can be committed")
        before = len(seq.output_token_ids)
        reason = None
        for token in ([tokens] if isinstance(tokens, int) else tokens):
            reason = self._commit_one(seq, st, int(token))
            if reason:
                break
        st.num_new = len(seq.output_token_ids) - before
        return self._finalize(seq, st, reason) if reason else None

    def commit_plain(self, seq, token: int) -> RequestOutput | None:
        """commit and output in one call for the common decode row: one token that ends nothing, for a request
        whose text is not streamed (decoded at the end, or none) and that wants no logprobs. None: not that case,
        and nothing was done (the caller takes commit and output)."""
        st = getattr(seq, "out", None)
        if st is None or st.reason is not None or not (st.lazy or st.detok is None) or seq.logprobs is not None \
                or token < 0 or token in self.eos_ids or token in seq.params.stop_token_ids \
                or seq.num_tokens + 1 >= seq.max_len:
            return None
        seq.output_token_ids.append(token)
        st.num_new = 1
        return RequestOutput(seq.seq_id, (token,), "", False)

    def _commit_one(self, seq, st: OutputState, token: int) -> str | None:
        seq.output_token_ids.append(token)
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            st.token_stop = True
            return "stop"               # kept in the token ids, never in the text
        if st.detok is not None and not st.lazy and self._extend(seq, st, st.detok.add(token)):
            return "stop"
        if seq.num_tokens >= seq.max_len:
            return "length"
        return None

    @staticmethod
    def _extend(seq, st: OutputState, piece: str) -> bool:
        """Append `piece` to seq.text; True (and the text cut before it) when it completes a stop string."""
        if not piece:
            return False
        text = seq.text
        seq.text = ""           # drop the attribute's reference so CPython grows `text` in place, not copies it
        before = len(text)
        text += piece
        start = None
        if st.stops is not None:
            st.stop_state, start = st.stops.feed(st.stop_state, piece)
        end = start if start is None or not st.keep_stop else start + st.stops.match[st.stop_state]
        seq.text = text if start is None else text[:before + end]
        st.cut = start is not None
        return st.cut

    def _finalize(self, seq, st: OutputState, reason: str) -> str:
        """End the request: the detokenizer's held tail joins the text (unless a stop string cut it)."""
        if st.lazy:     # tokenizer.decode's text, through the Rust decode where the two agree (_decoder)
            ids = seq.output_token_ids
            seq.text = _decoder(self.tokenizer, False)(ids[:len(ids) - st.token_stop])
        elif st.detok is not None and not st.cut and self._extend(seq, st, st.detok.flush()):
            reason = "stop" if reason == "length" else reason
        st.reason = reason
        return reason

    def output(self, seq, num_new: int | None = None, finished: bool = False, reason: str | None = None,
               error: str | None = None) -> RequestOutput:
        """This commit's output: the last num_new tokens (default: what the last commit appended) and the text
        newly safe to stream. While unfinished it holds back a tail that may still become a stop string (and
        the detokenizer holds an incomplete character); the final output releases everything up to the cut
        and carries token_ids and text."""
        st = getattr(seq, "out", None) or self._state(seq)
        ids = seq.output_token_ids
        num_new = st.num_new if num_new is None else num_new
        lps = None if seq.logprobs is None else tuple(seq.logprobs[len(seq.logprobs) - num_new:]) if num_new else ()
        # the hot path: no text to release now (decoded at the end, or none at all: the server's engine process)
        if (st.lazy or st.detok is None) and not finished and st.reason is None and 0 <= num_new <= len(ids):
            return RequestOutput(seq.seq_id, tuple(ids[len(ids) - num_new:]), "", False, logprobs=lps)
        if not 0 <= num_new <= len(ids):
            raise ValueError(f"num_new={num_new} but request {seq.seq_id} has {len(ids)} output tokens")
        if st.finished and not finished:
            raise ValueError(f"request {seq.seq_id} finished ({st.reason}): its output must be final")
        if finished and not st.finished:
            if reason is None:
                raise ValueError("a final output needs a finish reason")
            self._finalize(seq, st, reason)
        text = seq.text
        held = st.stops.held(st.stop_state) if st.stops is not None else 0
        end = len(text) if finished else max(st.sent, len(text) - held)
        new_text, st.sent = text[st.sent:end], end
        new_ids = tuple(ids[len(ids) - num_new:])
        if not finished:
            return RequestOutput(seq.seq_id, new_ids, new_text, False, logprobs=lps)
        return RequestOutput(seq.seq_id, new_ids, new_text, True, st.reason, error, tuple(ids), text, logprobs=lps)

    def fail(self, seq, reason: str, error: str | None = None) -> RequestOutput:
        """Final output of an aborted or failed request (no new tokens)."""
        if reason not in ("abort", "error"):
            raise ValueError(f"fail() is for 'abort' or 'error', got {reason!r}")
        st = self._state(seq)
        if not st.finished:
            self._finalize(seq, st, reason)
        st.reason = reason          # the caller's verdict stands even over a stop it raced with
        return self.output(seq, 0, True, error=error)
