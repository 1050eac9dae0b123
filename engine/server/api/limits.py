"""Bounds on what one request may make the server read, parse and tokenize, checked before the work.

A body past `max_body_bytes` is refused with 413 while it is read (its Content-Length first, then the bytes
as they arrive), so a 10 MB body is never parsed. A prompt text is refused before tokenizing when it has
more bytes than the context could hold: no token of the vocabulary is longer than `token_bytes`, so a text of
more than `max_model_len * token_bytes` bytes has at least `max_model_len` tokens. The bound is exact for
the vocabulary and never refuses a prompt that fits. The same bound refuses a JSON schema whose shortest instance
(minLength, minItems, required properties: engine/guided/limits.py `min_chars`) needs more tokens than the context
leaves after the prompt: no output could satisfy it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.guided.limits import min_chars
from engine.server.openai.protocol import APIError

DEFAULT_MAX_BODY_BYTES = 4 << 20     # 4 MiB: a full 128k-token context of text is ~0.5 MB


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_bytes: int | None = None     # None: no tokenizer (prompts come as token ids)
    token_bytes: int = 0                    # bytes of the vocabulary's longest token (0: no tokenizer)

    @classmethod
    def for_model(cls, tokenizer, max_model_len: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be > 0, got {max_body_bytes}")
        if tokenizer is None:
            return cls(max_body_bytes, None)
        longest = longest_token_bytes(tokenizer)
        return cls(max_body_bytes, max_model_len * longest, longest)

    def check_prompt(self, text: str) -> None:
        """Raise a 400 when `text` cannot fit the context, before it is tokenized."""
        if self.max_prompt_bytes is None:
            return
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise APIError(f"the prompt is {size} bytes, more than the context can hold "
                           f"({self.max_prompt_bytes} bytes at most for this model)", param="messages")


    def check_output_fits(self, schema, room: int, what: str, param: str | None) -> None:
        """Raise a 400 when no instance of the JSON `schema` fits in `room` tokens."""
        chars = min_chars(schema)
        if not self.token_bytes or chars <= room * self.token_bytes:
            return
        need = -(-chars // self.token_bytes)
        raise APIError(f"{what} cannot fit the context: its shortest instance has {chars} characters, at least {need} "
                       f"tokens of this model, and the context leaves {room} after the prompt", param=param)

    def check_guide_fits(self, guide, room: int, param: str | None) -> None:
        if guide.kind == "json_schema":
            self.check_output_fits(json.loads(guide.source), room, "json_schema", param)


def longest_token_bytes(tokenizer) -> int:
    """Bytes of the vocabulary's longest token as written (an upper bound of the text it covers)."""
    return max(len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab())


async def read_body(request, limit: int) -> bytes:
    """The request's body, or a 413 as soon as it is known to pass `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request, limit: int) -> dict:
    """The request's body as a JSON object, or a 413 (too large) or a 400 (not JSON, nested too deeply, not
    an object)."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise APIError("the request body is nested too deeply") from exc
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def _too_large(size: int, limit: int) -> APIError:
    return APIError(f"the request body is {size} bytes or more; this server takes at most {limit} "
                    f"(--max-request-bytes)", status=413, code="request_too_large")
