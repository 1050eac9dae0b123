"""Tool calling: which tools the prompt shows, the structural tag that constrains the calls, and the parser
that turns output text back into `tool_calls`.

How a call is written is the model's tool format (engine/server/openai/tool_formats.py: hermes, llama3_json,
mistral).
The grammar forces everything of a call but its arguments, which follow the tool's `parameters` schema:
- `required`: one or more calls (one with parallel_tool_calls=false, or in a one-call format) and nothing else;
- a named function: exactly one call of it;
- `auto`: free text, in which the format's opening text starts a constrained call (xgrammar's triggered tags);
  with a response format (a JSON schema or object), either calls or an answer in that format, nothing else;
- `none`: the tools are left out of the prompt and nothing is constrained.
Under `required` or a named function the output is calls only, so a response format has nothing to shape.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from engine.guided.guide import grammar_schema
from engine.server.openai.protocol import APIError
from engine.server.openai.tool_formats import Hermes, ToolFormat

HERMES = Hermes()
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_EMPTY_PARAMS = {"type": "object", "properties": {}}
MARK = "$comment"      # an annotation: the grammar ignores it, guides.py reads it to name a refused schema


@dataclass(frozen=True)
class ToolPlan:
    mode: str                        # "none" | "auto" | "required" | "named"
    tools: list[dict] | None         # what the prompt shows
    guide: dict | None               # xgrammar structural tag, or None
    fmt: ToolFormat = HERMES

    def parser(self) -> ToolCallParser | None:
        """A new parser for one choice's output; None when tools are off."""
        return None if self.mode == "none" else ToolCallParser(self.fmt, forced=self.mode in ("required", "named"))


def _check_tool(i: int, tool) -> dict:
    where = f"tools[{i}]"
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict):
        raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(f"{where}.function.name must be 1-64 letters, digits, _ . or -, got {name!r}",
                       param=f"{where}.function.name")
    params = fn.get("parameters") or _EMPTY_PARAMS
    if not isinstance(params, dict):
        raise APIError(f"{where}.function.parameters must be a JSON schema object",
                       param=f"{where}.function.parameters")
    kind = params.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise APIError(f"{where}.function.parameters must be a JSON schema of type 'object' (a call's arguments are "
                       f"an object), got type {json.dumps(kind)[:100]}", param=f"{where}.function.parameters")
    out = {"name": name, "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _for_grammar(schema: dict, param: str) -> dict:
    """The schema the call's grammar is compiled from (rewritten, checked: APIError naming `param`), marked with
    `param` so that a later refusal of the whole tag (a bound, a compile error) can name the field
    (engine/server/api/guides.py)."""
    try:
        rewritten = grammar_schema(schema, param)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from exc
    return {**rewritten, MARK: param}


def _tagged(fmt: ToolFormat, i: int, tool: dict) -> dict:
    fn = tool["function"]
    where = f"tools[{i}].function.parameters"
    return fmt.tag({**tool, "function": {**fn, "parameters": _for_grammar(fn["parameters"], where)}})


def _named(choice, names: list[str]) -> str:
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if name not in names:
        raise APIError(f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})",
                       param="tool_choice")
    return name


def plan_tools(tools, tool_choice, parallel: bool, answer: dict | None = None, fmt: ToolFormat = HERMES) -> ToolPlan:
    """answer: the request's response format as guide fields ({} or None: free text)."""
    if tools is not None and not isinstance(tools, list):
        raise APIError("tools must be a list", param="tools")
    checked = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise APIError("tools have duplicate function names", param="tools")
    choice = tool_choice if tool_choice is not None else ("auto" if checked else "none")
    if choice == "none":
        return ToolPlan("none", None, None, fmt)
    if not checked:
        raise APIError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    tags = [_tagged(fmt, i, t) for i, t in enumerate(checked)]
    one = not parallel or fmt.single_call
    if isinstance(choice, dict):
        name = _named(choice, names)
        return ToolPlan("named", checked, _structural(fmt.calls([tags[names.index(name)]], True)), fmt)
    if choice == "required":
        return ToolPlan("required", checked, _structural(fmt.calls(tags, one)), fmt)
    if choice == "auto" and answer:
        either = {"type": "or", "elements": [fmt.calls(tags, one), _answer_format(answer)]}
        return ToolPlan("auto", checked, _structural(either), fmt)
    if choice == "auto":
        return ToolPlan("auto", checked, _structural(fmt.auto(tags, one)), fmt)
    raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                   param="tool_choice")


def _answer_format(answer: dict) -> dict:
    if answer.get("json_object"):
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if "json_schema" in answer:
        schema = answer["json_schema"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(schema, dict):
            raise APIError("response_format's schema must be a JSON object", param="response_format")
        return {"type": "json_schema", "json_schema": _for_grammar(schema, "response_format")}
    raise APIError(f"tools under tool_choice 'auto' combine only with a JSON response format, not {next(iter(answer))}",
                   param="response_format")


def _structural(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def _new_call(fmt: ToolFormat, name: str, arguments: dict) -> dict:
    return {"id": fmt.new_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolCallParser:
    """Splits output text, as it streams, into content and whole tool calls, in the model's tool format. Text that
    may be the start of a call (the format's cue: `<tool_call>`, `{"name"`, `[TOOL_CALLS]`) is held back until it
    is known not to be.

    forced (tool_choice "required" or a named function): the output is calls only. The grammar allows nothing
    but separators between them, so no text is content, and a call cut off by the length limit is dropped.
    Otherwise whitespace-only text beside calls is not content either (OpenAI's content is null when there are
    only calls): a run of it is held until non-space text follows (then it goes out with it, unless a call came
    before it), a call follows (dropped), or the output ends (content only when there was no call)."""

    def __init__(self, fmt: ToolFormat = HERMES, forced: bool = False):
        self.fmt, self.forced, self._cues = fmt, forced, fmt.cues()
        self._buf, self._in_call = "", False
        self._held, self._text_open, self._calls = "", False, 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        """-> [("content", str) | ("call", tool call dict)] released by this text."""
        self._buf += text
        events: list = []
        while True:
            if self._in_call:
                found = self.fmt.region(self._buf)
                if found is None:
                    return events
                length, calls = found
                if calls:
                    for name, args in calls:
                        self._call(events, _new_call(self.fmt, name, args))
                else:
                    self._emit(events, self._buf[:length])
                self._buf, self._in_call = self._buf[length:], False
                continue
            start = min((i for i in (self._buf.find(c) for c in self._cues) if i >= 0), default=-1)
            if start >= 0:
                self._emit(events, self._buf[:start])
                self._buf, self._in_call = self._buf[start:], True
                continue
            keep = max(_partial(self._buf, c) for c in self._cues)
            self._emit(events, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return events

    def finish(self) -> list[tuple[str, object]]:
        """The rest, at the end of the output: an unfinished call is content (dropped when forced)."""
        events: list = []
        if not (self._in_call and self.forced):
            self._emit(events, self._buf)
        if self._held and not self._calls and not self.forced:
            events.append(("content", self._held))
        self._buf, self._in_call, self._held = "", False, ""
        return events

    def _call(self, events: list, call: dict) -> None:
        events.append(("call", call))
        self._calls += 1
        self._held, self._text_open = "", False

    def _emit(self, events: list, text: str) -> None:
        if not text or self.forced:
            return
        if not self._text_open and not text.strip():
            self._held += text
            return
        if not self._text_open:
            text = text.lstrip() if self._calls else self._held + text
        events.append(("content", text))
        self._held, self._text_open = "", True


def _partial(text: str, cue: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `cue`."""
    for n in range(min(len(text), len(cue) - 1), 0, -1):
        if cue.startswith(text[-n:]):
            return n
    return 0
