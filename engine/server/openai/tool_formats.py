"""How a model writes a tool call, chosen from its chat template (or `--tool-call-parser`).

A format gives the structural tag of one call (what xgrammar constrains), how calls are joined, the text that
opens a call in free output (auto's trigger, the parser's cue), how a finished region of output turns back into
calls, and how earlier calls are written into a prompt:
- hermes (Qwen2/2.5/3, Hermes, and the fallback): `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`;
- llama3_json (Llama 3.1/3.2/3.3): one bare `{"name": N, "parameters": {...}}` per turn (the templates refuse
  more than one call in a turn); the `<|python_tag|>` some outputs begin with is accepted where the template
  knows it, never generated (the templates ask for plain JSON for custom tools);
- mistral (Mistral 7B v0.3, Mixtral...): `[TOOL_CALLS] [{"name": N, "arguments": {...}}, ...]`, call ids of 9
  letters and digits, as its template demands. Grammars never emit special tokens (engine/guided/compiler.py
  blanks them), so where the vocabulary has `[TOOL_CALLS]` as one, a constrained call spells it in ordinary
  tokens; the parser reads either.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
import uuid

PYTHON_TAG = "<|python_tag|>"
_ALNUM = string.ascii_letters + string.digits


def json_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that opens at text[start], or None while it is unfinished."""
    depth, in_str, escape = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


NOT_JSON = object()


def json_value(buf: str, start: int, openers: str):
    """The JSON object or array at buf[start], leading whitespace skipped: None while it may still be coming,
    (where it stops, NOT_JSON) when it opens with none of `openers` or does not parse, else (end, value)."""
    start += len(buf[start:]) - len(buf[start:].lstrip())
    if start == len(buf):
        return None
    if buf[start] not in openers:
        return start, NOT_JSON
    end = json_end(buf, start)
    if end is None:
        return None
    try:
        return end, json.loads(buf[start:end])
    except json.JSONDecodeError:
        return end, NOT_JSON


def _schema(tool: dict) -> dict:
    return {"type": "json_schema", "json_schema": tool["function"]["parameters"], "max_whitespace_cnt": 1}


def _arguments(obj, key: str = "arguments"):
    args = obj.get(key, {}) if isinstance(obj, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return args if isinstance(args, dict) else None


class ToolFormat:
    name = ""
    open_text = ""                  # what starts a call region in free text
    separator = "\n"                # between calls under required
    single_call = False             # one call per turn, whatever parallel_tool_calls says

    def tag(self, tool: dict) -> dict: ...
    def region(self, buf: str) -> tuple[int, list | None] | None:
        """buf starts with a cue: (length of the region, its calls or None when it is not calls), or None while
        the region is unfinished."""
    def write(self, calls: list[dict]) -> str: ...       # earlier calls, for a prompt without a tool template

    def cues(self) -> tuple[str, ...]:
        return (self.open_text,)

    def calls(self, tags: list[dict], stop_after_first: bool) -> dict:
        """One or more calls and nothing else."""
        return {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
                "stop_after_first": stop_after_first}

    def auto(self, tags: list[dict], stop_after_first: bool) -> dict:
        """Free text in which the cue starts a constrained call."""
        return {"type": "triggered_tags", "triggers": [self.open_text], "tags": tags, "at_least_one": False,
                "stop_after_first": stop_after_first}

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def history_id(self, call_id: str) -> str:
        return call_id

    def instructions(self) -> str:
        return ("To call a function, write a JSON object with its name and arguments between <tool_call></tool_call> "
                'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')


class Hermes(ToolFormat):
    name, open_text = "hermes", "<tool_call>"
    close_text = "</tool_call>"

    def tag(self, tool):
        name = json.dumps(tool["function"]["name"])
        return {"type": "tag", "begin": f'{self.open_text}\n{{"name": {name}, "arguments": ', "content": _schema(tool),
                "end": f"}}\n{self.close_text}"}

    def region(self, buf):
        end = buf.find(self.close_text)
        if end < 0:
            return None
        try:
            obj = json.loads(buf[len(self.open_text):end])
        except json.JSONDecodeError:
            obj = None
        args = _arguments(obj)
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and args is not None
        return end + len(self.close_text), ([(obj["name"], args)] if ok else None)

    def write(self, calls):
        return "\n".join(f"{self.open_text}\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
                         + f"\n{self.close_text}" for n, a in calls)


class Llama3Json(ToolFormat):
    name, open_text, separator, single_call = "llama3_json", '{"name": ', "; ", True

    def __init__(self, python_tag: bool = False):
        self.python_tag = python_tag

    def cues(self):
        return ('{"name"', PYTHON_TAG) if self.python_tag else ('{"name"',)

    def tag(self, tool):
        name = json.dumps(tool["function"]["name"])
        return {"type": "tag", "begin": f'{{"name": {name}, "parameters": ', "content": _schema(tool), "end": "}"}

    def region(self, buf):
        found = json_value(buf, len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0, "{")
        if found is None or found[1] is NOT_JSON:
            return found and (found[0], None)
        end, obj = found
        key = next((k for k in ("parameters", "arguments") if isinstance(obj, dict) and k in obj), None)
        args = _arguments(obj, key) if key else None
        ok = isinstance(obj.get("name"), str) and args is not None
        return end, ([(obj["name"], args)] if ok else None)

    def write(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def instructions(self):
        return ('To call a function, respond with only a JSON object in the format {"name": function name, '
                '"parameters": dictionary of argument name and its value}. Do not use variables.')


class Mistral(ToolFormat):
    name, open_text, separator = "mistral", "[TOOL_CALLS]", ", "

    def tag(self, tool):
        name = json.dumps(tool["function"]["name"])
        return {"type": "tag", "begin": f'{{"name": {name}, "arguments": ', "content": _schema(tool), "end": "}"}

    def calls(self, tags, stop_after_first):
        return {"type": "tag", "begin": self.open_text + " [", "content": super().calls(tags, stop_after_first),
                "end": "]"}

    def auto(self, tags, stop_after_first):
        return {"type": "triggered_tags", "triggers": [self.open_text], "tags": [self.calls(tags, stop_after_first)],
                "at_least_one": False, "stop_after_first": True}

    def region(self, buf):
        found = json_value(buf, len(self.open_text), "[{")
        if found is None or found[1] is NOT_JSON:
            return found and (found[0], None)
        end, items = found
        items = items if isinstance(items, list) else [items]
        calls = [(o.get("name"), _arguments(o)) for o in items if isinstance(o, dict)]
        ok = len(calls) == len(items) and all(isinstance(n, str) and a is not None for n, a in calls)
        return end, (calls if ok and calls else None)

    def write(self, calls):
        return self.open_text + " " + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def new_id(self):
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def history_id(self, call_id):
        """Mistral's template takes only 9-letter-or-digit ids: others (OpenAI's call_...) map to one, the same for
        a call and its result."""
        if re.fullmatch(r"[A-Za-z0-9]{9}", call_id or ""):
            return call_id
        return hashlib.sha256((call_id or "").encode()).hexdigest()[:9]

    def instructions(self):
        return ('To call functions, write [TOOL_CALLS] followed by a JSON list of the calls: '
                '[TOOL_CALLS] [{"name": <function-name>, "arguments": <arguments-json-object>}]')


NAMES = ("hermes", "llama3_json", "mistral")


def detect(template: str) -> str:
    """The format a chat template shows: its own marks for calls, else hermes (also the fallback's)."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and ('"parameters"' in template or PYTHON_TAG in template):
        return "llama3_json"
    return "hermes"


def template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else json.dumps(template)


def resolve(tokenizer, choice: str = "auto") -> ToolFormat:
    """The tool-call format for this tokenizer's template, or the one `--tool-call-parser` names."""
    template = template_text(tokenizer)
    name = detect(template) if choice == "auto" else choice
    if name == "llama3_json":
        return Llama3Json(python_tag=PYTHON_TAG in template)
    if name == "mistral":
        return Mistral()
    if name == "hermes":
        return Hermes()
    raise ValueError(f"unknown tool-call format {choice!r}: choose auto, {', '.join(NAMES)}")
