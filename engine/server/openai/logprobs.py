"""Logprobs in OpenAI's shapes: chat's `logprobs.content[]`, the legacy completions object, and the Responses
API's `output_text.logprobs`, built from the engine's per-token entries (engine/sampling/logprobs.py: (the token's
logprob, [(token id, logprob), ...] best first)); an entry that crossed the engine process's IPC frames is the
same as lists.

Every output token has an entry, the token that ended the request (EOS, a stop token id) included: the entries
count the tokens `usage.completion_tokens` counts. A token's text is its bytes decoded as UTF-8 (a token holding
part of a character shows U+FFFD); `bytes` are its exact bytes.
"""
from __future__ import annotations

import functools


class TokenTable:
    """Each token id's bytes and text; a model without a tokenizer names its tokens "token_id:<id>"."""

    def __init__(self, tokenizer):
        self._bytes: list[bytes] = []
        if tokenizer is not None:
            import xgrammar as xgr        # its table keeps byte-level and byte-fallback tokens' exact bytes
            self._bytes = [bytes(b) for b in xgr.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab]

    def raw(self, token: int) -> bytes:
        return self._bytes[token] if 0 <= token < len(self._bytes) else f"token_id:{token}".encode()

    def text(self, token: int) -> str:
        return self.raw(token).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=4)
def token_table(tokenizer) -> TokenTable:
    """Built once per tokenizer, in time that grows with its vocabulary: call it off the event loop the first time."""
    return TokenTable(tokenizer)


def _item(table: TokenTable, token: int, logprob: float) -> dict:
    return {"token": table.text(token), "logprob": logprob, "bytes": list(table.raw(token))}


def chat_content(table: TokenTable, ids, entries) -> list[dict]:
    """Chat Completions' `logprobs.content` (and the Responses API's `logprobs`) for these tokens."""
    return [dict(_item(table, token, lp), top_logprobs=[_item(table, t, v) for t, v in top])
            for token, (lp, top) in zip(ids, entries)]


def completion_logprobs(table: TokenTable, ids, entries, offset: int = 0) -> tuple[dict, int]:
    """The completions API's logprobs object for these tokens, their text starting at character `offset` of the
    choice's text; -> (object, the offset after them)."""
    tokens, offsets = [], []
    for token in ids:
        offsets.append(offset)
        tokens.append(table.text(token))
        offset += len(tokens[-1])
    body = {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{table.text(t): v for t, v in top} for _, top in entries], "text_offset": offsets}
    return body, offset


def prompt_logprobs(table: TokenTable, entries) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for it and the most likely tokens at its place (engine/sampling/prompt_logprobs.py)."""
    out: list = [None]
    for token, logprob, rank, top in entries:
        scores = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": table.text(token)}}
        for i, (t, v) in enumerate(top):
            scores.setdefault(str(t), {"logprob": v, "rank": i + 1, "decoded_token": table.text(t)})
        out.append(scores)
    return out
