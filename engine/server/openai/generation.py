"""One HTTP request's choices as they run: per-choice state, and the bodies the client gets (a whole response,
or SSE chunks). Chat and text completions differ only in their `Format`."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from engine.server.openai.logprobs import TokenTable, chat_content, completion_logprobs, prompt_logprobs
from engine.server.openai.protocol import APIError
from engine.server.openai.tools import ToolCallParser
from engine.server.processes.submission import ENGINE_STOPPED, Submission

WARNING_HEADER = "specdec-warning"      # what a response did not do as asked (docs/server.md)
_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def client_error(message: str) -> bool:
    """Engine failures that the request caused (its grammar), as opposed to the server's own."""
    return message.startswith("invalid ") or "no token was allowed" in message


def failure(message: str) -> APIError:
    if client_error(message):
        return APIError(message)
    if message.startswith(ENGINE_STOPPED):
        return APIError(message, status=503, type="server_error", code="engine_stopped")
    return APIError(f"the request failed: {message}", status=500, type="server_error")


@dataclass
class ChoiceState:
    parser: ToolCallParser | None
    content: list[str] = field(default_factory=list)      # the text outside tool calls (all of it without tools)
    tool_calls: list[dict] = field(default_factory=list)
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    spec: dict | None = None
    cached: int = 0                    # prompt tokens found in the prefix cache
    last: float | None = None          # when its previous tokens arrived
    seen: int = 0                      # tokens counted by then
    # tokens with logprobs, and their entries (engine/sampling/logprobs.py)
    lp_ids: list = field(default_factory=list)
    lp: list = field(default_factory=list)
    lp_sent: int = 0                   # entries streamed so far
    lp_offset: int = 0                 # completions: characters of token text streamed so far (text_offset)
    prompt_lp: list | None = None      # prompt_logprobs entries (engine/sampling/prompt_logprobs.py)
    closed_by: str | None = None       # the engine closed this guided output: "budget" or "repetition"

    def take(self, out) -> list[tuple[str, object]]:
        """Fold in one RequestOutput; -> the content / tool-call events it releases (a call carries its index
        among the choice's calls, as a streamed delta does)."""
        self.tokens += len(out.new_token_ids)
        if out.logprobs is not None:
            self.lp_ids += out.new_token_ids
            self.lp += out.logprobs
        events = self.parser.feed(out.new_text) if self.parser else (
            [("content", out.new_text)] if out.new_text else [])
        if out.finished:
            self.finish, self.error, self.spec = out.finish_reason, out.error, out.spec
            self.cached, self.prompt_lp, self.closed_by = out.cached_tokens, out.prompt_logprobs, out.closed_by
            events += self.parser.finish() if self.parser else []
        released = []
        for kind, item in events:
            if kind == "call":
                released.append((kind, dict(item, index=len(self.tool_calls))))
                self.tool_calls.append(item)
            else:
                released.append((kind, item))
                self.content.append(item)
        return released

    def finish_reason(self) -> str:
        if self.tool_calls:
            return "tool_calls"
        return "length" if self.finish == "length" else "stop"


def closed(choice: dict, st: ChoiceState) -> dict:
    """A choice whose guided output the engine closed says so (engine/guided/closing.py): `closed_by`."""
    if st.closed_by is not None:
        choice["closed_by"] = st.closed_by
    return choice


class Format:
    """What differs between chat.completion and text_completion."""
    object_full = object_chunk = ""
    id_prefix = ""

    def full_choice(self, index: int, st: ChoiceState, logprobs=None) -> dict: ...
    def deltas(self, events) -> list[dict]: ...
    def logprobs(self, table: TokenTable, st: ChoiceState, start: int): ...
    def opening(self) -> dict | None: ...
    def closing(self, st: ChoiceState) -> dict: ...


class ChatFormat(Format):
    object_full, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def full_choice(self, index, st, logprobs=None):
        content = "".join(st.content)
        message = {"role": "assistant", "content": None if st.tool_calls and not content.strip() else content}
        if st.tool_calls:
            message["tool_calls"] = st.tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": st.finish_reason()}

    def logprobs(self, table, st, start):
        return {"content": chat_content(table, st.lp_ids[start:], st.lp[start:])}

    def deltas(self, events):
        out = []
        for kind, item in events:
            if kind == "call":
                out.append({"tool_calls": [item]})
            elif out and "content" in out[-1]:
                out[-1]["content"] += item
            else:
                out.append({"content": item})
        return out

    def opening(self):
        return {"role": "assistant", "content": ""}

    def chunk_choice(self, index, delta, finish=None, logprobs=None):
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def closing(self, st):
        return {}


class CompletionFormat(Format):
    object_full, object_chunk, id_prefix = "text_completion", "text_completion", "cmpl-"

    def full_choice(self, index, st, logprobs=None):
        return {"index": index, "text": "".join(st.content), "logprobs": logprobs, "finish_reason": st.finish_reason()}

    def logprobs(self, table, st, start):
        body, st.lp_offset = completion_logprobs(table, st.lp_ids[start:], st.lp[start:], st.lp_offset if start else 0)
        return body

    def deltas(self, events):
        text = "".join(item for _, item in events)
        return [text] if text else []

    def opening(self):
        return None

    def chunk_choice(self, index, delta, finish=None, logprobs=None):
        return {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}

    def closing(self, st):
        return ""


class Generation:
    """Drives one Submission to the end, for a whole response or as SSE."""

    def __init__(self, fmt: Format, sub: Submission, model: str, prompt_tokens: int, tools, metrics,
                 arrival: float, table: TokenTable | None = None, notes=(), request_id: str | None = None):
        """tools: the request's ToolPlan (its parser splits each choice's output), or None. table: token texts,
        when the choices ask for logprobs. notes: what the response header `specdec-warning` says. request_id:
        vLLM's, the response's id after the prefix."""
        self.fmt, self.sub, self.model, self.prompt_tokens, self.metrics = fmt, sub, model, prompt_tokens, metrics
        self.arrival, self.notes = arrival, list(notes)
        self.table = table if sub.params[0].logprobs is not None else None
        self.prompt_table = table if sub.params[0].prompt_logprobs is not None else None
        self.id = fmt.id_prefix + (request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.choices = [ChoiceState(tools.parser() if tools else None) for _ in sub.params]
        self.open = len(self.choices)

    def headers(self) -> dict:
        """The notes as a header (ASCII: a header's bytes are Latin-1)."""
        if not self.notes:
            return {}
        return {WARNING_HEADER: "; ".join(self.notes).encode("ascii", "backslashreplace").decode()}

    async def batches(self):
        """Per batch of outputs: {choice index: the content / tool-call events it released}."""
        while self.open:
            batch = await self.sub.next_batch()
            now = time.perf_counter()
            per_choice: dict[int, list] = {}
            for index, out in batch:
                st = self.choices[index]
                per_choice.setdefault(index, []).extend(st.take(out))
                self.open -= out.finished
            for index in per_choice:
                self._observe(self.choices[index], now)
            yield per_choice

    def _observe(self, st: ChoiceState, now: float) -> None:
        if st.tokens and st.last is None:
            self.metrics.first_token(now - self.arrival)
            st.last, st.seen = now, st.tokens
        elif st.last is not None and st.tokens > st.seen:
            self.metrics.inter_token(now - st.last, st.tokens - st.seen)
            st.last, st.seen = now, st.tokens

    def usage(self) -> dict:
        done = sum(st.tokens for st in self.choices)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                 "total_tokens": self.prompt_tokens + done,
                 # the choices share the prompt: the most any of them found cached
                 "prompt_tokens_details": {"cached_tokens": max((st.cached for st in self.choices), default=0)}}
        specs = [st.spec for st in self.choices if st.spec]
        if specs:
            steps, accepted = sum(s["steps"] for s in specs), sum(s["accepted"] for s in specs)
            usage["speculative"] = {"steps": steps, "proposed": sum(s["proposed"] for s in specs), "accepted": accepted,
                                    "acceptance_length": round((steps + accepted) / steps, 4) if steps else 0.0}
        return usage

    def _finished(self) -> None:
        self.metrics.finished(self)

    def abandon(self) -> None:
        """The client left: the open choices count as aborted (their requests are being aborted)."""
        for st in self.choices:
            st.finish = st.finish or "abort"
        self.open = 0
        self._finished()

    async def full(self) -> dict:
        async for _ in self.batches():
            pass
        self._finished()
        errors = [st.error or "failed" for st in self.choices if st.finish == "error"]
        if errors:
            raise failure(errors[0])
        body = {"id": self.id, "object": self.fmt.object_full, "created": self.created, "model": self.model,
                "choices": [closed(self.fmt.full_choice(i, st, self.logprobs(st)), st)
                            for i, st in enumerate(self.choices)],
                "usage": self.usage()}
        if self.prompt_table is not None:          # vLLM's places: chat's at the top, each completion choice's
            scored = [prompt_logprobs(self.prompt_table, st.prompt_lp or []) for st in self.choices]
            if self.fmt.id_prefix == "chatcmpl-":
                body["prompt_logprobs"] = scored[0]
            else:
                for choice, entries in zip(body["choices"], scored):
                    choice["prompt_logprobs"] = entries
        return body

    def logprobs(self, st: ChoiceState, streamed: bool = False):
        """The logprobs object of the choice's entries not streamed yet (all of them: a whole response), or None
        when the request asked for none."""
        if self.table is None:
            return None
        start = st.lp_sent if streamed else 0
        st.lp_sent = len(st.lp)
        return self.fmt.logprobs(self.table, st, start)

    def _chunk(self, choices: list, usage: dict | None = None) -> str:
        body = {"id": self.id, "object": self.fmt.object_chunk, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {_DUMPS(body)}\n\n"

    async def sse(self, include_usage: bool, continuous_usage: bool):
        """SSE text chunks: deltas as they come (several tokens per chunk when the client lags), a finish
        chunk per choice, then usage (include_usage), then [DONE]."""
        opening = self.fmt.opening()
        if opening is not None:
            yield self._chunk([self.fmt.chunk_choice(i, opening) for i in range(len(self.choices))])
        async for per_choice in self.batches():
            parts, finished = [], []
            for index, events in per_choice.items():
                st = self.choices[index]
                for i, delta in enumerate(self.fmt.deltas(events)):     # new entries ride on the first delta
                    parts.append(self.fmt.chunk_choice(index, delta, logprobs=None if i else self.logprobs(st, True)))
                if st.finish is not None:
                    finished.append(index)
            usage = self.usage() if continuous_usage else None
            for part in parts:
                yield self._chunk([part], usage)
            for index in finished:
                st = self.choices[index]
                if st.finish == "error":
                    err = failure(st.error or "failed")
                    yield f"data: {_DUMPS(err.body())}\n\n"
                    continue
                yield self._chunk([closed(self.fmt.chunk_choice(index, self.fmt.closing(st), st.finish_reason(),
                                                                self.logprobs(st, True)), st)], usage)
        self._finished()
        if include_usage:
            yield self._chunk([], self.usage())
        yield "data: [DONE]\n\n"
