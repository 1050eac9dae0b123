"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path.

A request becomes a chat request: `instructions` a system message, `input` (text, or items: messages,
`function_call`, `function_call_output`) the messages, function tools and `tool_choice` the chat ones, and
`text.format` the response format. Its output comes back as Responses items: one `message` with
`output_text`, and a `function_call` per tool call. `previous_response_id` continues a stored response: the
server keeps the last RESPONSES_KEPT responses' conversations in memory (not across restarts); an unknown or
dropped id is a 400.

Fields that would change what the output means are honoured or refused, never dropped: `truncation` is
"disabled" (a prompt that does not fit is a 400; "auto" would drop input, which this server does not do);
`reasoning` asks nothing of a model that does not reason (the server runs none: an effort other than "none", or a
summary, is a 400); `include` may name the extra data of items this server never outputs (web or file search,
computer use, code interpreter, input images: those tools and parts are refused), so there is nothing to add, and
"reasoning.encrypted_content" (no reasoning items). "message.output_text.logprobs" or `top_logprobs` asks for
logprobs: the last message's output_text part carries them (for every output token), in the whole response and
in the stream's closing events; the text deltas carry none.
"""
from __future__ import annotations

import collections
import json
import threading
import time
import uuid

from pydantic import Field

from engine.sampling.limits import MAX_LOGPROBS
from engine.server.openai.protocol import APIError, RequestBody

RESPONSES_KEPT = 1024
LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(RequestBody):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict | None = None
    user: str | None = None
    truncation: str = "disabled"
    reasoning: dict | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM-style extensions, as on the chat endpoint
    seed: int | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    close_at_budget: bool = True
    repetition_guard: bool = True


class ResponseStore:
    """Conversations of recent responses by id (bounded; the oldest goes first). Used from the event loop and
    its worker threads, hence the lock."""

    def __init__(self, kept: int = RESPONSES_KEPT):
        self.kept, self._lock = kept, threading.Lock()
        self._items: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()

    def get(self, response_id: str) -> list[dict]:
        with self._lock:
            messages = self._items.get(response_id)
        if messages is None:
            raise APIError(f"previous response {response_id!r} is not found (this server keeps the last "
                           f"{self.kept}, in memory)", param="previous_response_id", code="previous_response_not_found")
        return list(messages)

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = messages
            while len(self._items) > self.kept:
                self._items.popitem(last=False)


NOTHING_TO_INCLUDE = frozenset({
    "reasoning.encrypted_content", "web_search_call.results", "web_search_call.action.sources",
    "file_search_call.results", "computer_call_output.output.image_url", "message.input_image.image_url",
    "code_interpreter_call.outputs"})


def check_fields(req: ResponsesRequest) -> None:
    """A 400 naming the field for what this server cannot honour (module docstring)."""
    if req.truncation != "disabled":
        raise APIError(f"truncation {req.truncation!r} is not supported: this server never drops input to fit the "
                       "context ('disabled', the default: a prompt that does not fit is a 400)", param="truncation")
    reasoning = req.reasoning or {}
    if reasoning.get("effort") not in (None, "none"):
        raise APIError(f"reasoning.effort {reasoning['effort']!r}: this server runs no reasoning (the model does not "
                       "reason here); leave it out or set 'none'", param="reasoning.effort")
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        raise APIError("reasoning.summary: this server runs no reasoning, so there is nothing to summarize",
                       param="reasoning.summary")
    for i, item in enumerate(req.include or []):
        if item not in NOTHING_TO_INCLUDE and item != LOGPROBS:
            raise APIError(f"include[{i}] {item!r} is not a known include value", param=f"include[{i}]")


def chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat completion request this Responses request asks for."""
    check_fields(req)
    messages = list(history)
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    messages += input_messages(req.input)
    body = {"model": req.model, "messages": messages, "parallel_tool_calls": req.parallel_tool_calls,
            "ignore_eos": req.ignore_eos, "close_at_budget": req.close_at_budget,
            "repetition_guard": req.repetition_guard}
    for key, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature), ("top_p", req.top_p),
                       ("seed", req.seed), ("top_k", req.top_k)):
        if value is not None:
            body[key] = value
    if req.top_logprobs is not None or LOGPROBS in (req.include or []):
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        body["response_format"] = _format(fmt)
    return body


def input_messages(value) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise APIError(f"input[{i}] has type {kind!r}; this server takes message, function_call and "
                           "function_call_output items", param=f"input[{i}]")
    return out


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                          for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise APIError(f"{where} must be text or a list of input_text parts", param=where)


def _tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise APIError(f"tools[{i}] has type {kind!r}; this server runs function tools only", param=f"tools[{i}]")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="text.format")


class ResponseBuilder:
    """One response's items, built from the chat path's events (content text, whole tool calls)."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self.items: list[dict] = []
        self.message: dict | None = None       # the open message item, while text arrives

    def text(self, delta: str) -> tuple[bool, dict]:
        """Append text; (True, item) when this opened a new message item."""
        opened = self.message is None
        if opened:
            self.message = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                            "role": "assistant", "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self.items.append(self.message)
        self.message["content"][0]["text"] += delta
        return opened, self.message

    def close_message(self) -> dict | None:
        item, self.message = self.message, None
        if item is not None:
            item["status"] = "completed"
        return item

    def logprobs(self, chat_logprobs: dict | None) -> None:
        """Chat's logprobs object of the whole output -> the last message's output_text part."""
        messages = [item for item in self.items if item["type"] == "message"]
        if chat_logprobs is not None and messages:
            messages[-1]["content"][0]["logprobs"] = chat_logprobs["content"]

    def call(self, call: dict) -> dict:
        item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
        self.items.append(item)
        return item

    def body(self, status: str, usage: dict | None, finish: str | None = None, error: dict | None = None) -> dict:
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": "incomplete" if incomplete and status == "completed" else status,
                "output": self.items, "incomplete_details": incomplete, "error": error,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "metadata": r.metadata or {},
                "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": r.previous_response_id,
                "temperature": r.temperature, "top_p": r.top_p, "tools": r.tools or [],
                "tool_choice": r.tool_choice or "auto", "text": r.text or {"format": {"type": "text"}},
                "truncation": r.truncation, "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
                "store": r.store, "usage": _usage(usage) if usage else None}

    def conversation(self, messages: list[dict]) -> list[dict]:
        """The chat messages of this exchange, its output included (what previous_response_id continues)."""
        text = "".join(c["text"] for item in self.items if item["type"] == "message" for c in item["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        reply: dict = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            reply["tool_calls"] = calls
        return [m for m in messages if m.get("role") != "system" or m.get("content") != self.req.instructions] + [reply]


def _usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def event(kind: str, seq: int, **fields) -> str:
    return (f"event: {kind}\n"
            f"data: {json.dumps({'type': kind, 'sequence_number': seq, **fields}, ensure_ascii=False)}\n\n")
