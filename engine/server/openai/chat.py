"""Chat messages -> prompt token ids, tools included.

A chat template that mentions `tools` gets them as the `tools` argument (Qwen2/3, Llama 3.1, Mistral...), and
earlier assistant tool calls with their arguments as objects (the templates write them with `tojson`) and ids
as the model's tool format wants them (Mistral's: 9 letters or digits). One that does not (SmolLM2's) gets the
fallback: the tools, as JSON, in the system message with how to call them in the tool format
(engine/server/openai/tool_formats.py; hermes unless `--tool-call-parser` names another), earlier assistant tool
calls written in that format and tool results sent as user turns inside <tool_response> tags.
"""
from __future__ import annotations

import json

from engine.server.openai.protocol import APIError
from engine.server.openai.tool_formats import Hermes, ToolFormat, template_text

ROLES = ("system", "developer", "user", "assistant", "tool")

TOOLS_FALLBACK = """# Tools

You can call functions to answer the user. Their signatures, as JSON, are inside <tools></tools>:
<tools>
{tools}
</tools>

{instructions}"""


def _text(content, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}",
                           param=f"{where}.content")
        parts.append(part["text"])
    return "".join(parts)


def normalize_messages(messages: list) -> list[dict]:
    """Checked copies: role, text content, assistant tool_calls, tool_call_id (a tool message answers an earlier
    assistant call, as OpenAI requires)."""
    out, call_ids = [], None        # None: no assistant call yet; else the ids of those seen
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise APIError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        msg = {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"), where)}
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise APIError(f"{where}.tool_calls must be a list, on an assistant message",
                               param=f"{where}.tool_calls")
            msg["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif msg["content"] is None:
            raise APIError(f"{where}.content is missing", param=f"{where}.content")
        if calls:
            call_ids = (call_ids or set()) | {c["id"] for c in msg["tool_calls"]}
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
            _check_answer(msg["tool_call_id"], call_ids, where)
        out.append(msg)
    return out


def _check_answer(call_id: str, call_ids: set | None, where: str) -> None:
    if call_ids is None:
        raise APIError(f"{where}: a message with role 'tool' must answer a tool call of an earlier assistant message",
                       param=f"{where}.role")
    if call_id and call_ids - {""} and call_id not in call_ids:
        raise APIError(f"{where}.tool_call_id {call_id!r} answers no tool call of an earlier assistant message"[:300],
                       param=f"{where}.tool_call_id")


def _past_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"{where}.function.name is missing", param=where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def supports_tools(tokenizer) -> bool:
    return "tools" in template_text(tokenizer)


def _pairs(calls: list[dict]) -> list[tuple[str, object]]:
    """(name, arguments as an object where they parse) of earlier calls."""
    out = []
    for c in calls:
        try:
            args = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            args = c["function"]["arguments"]
        out.append((c["function"]["name"], args))
    return out


def template_messages(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """The conversation for a template that writes tool calls itself."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": fmt.history_id(c["id"]), "type": "function",
                                "function": {"name": name, "arguments": args}}
                               for c, (name, args) in zip(m["tool_calls"], _pairs(m["tool_calls"]))]
        if m["role"] == "tool":
            m["tool_call_id"] = fmt.history_id(m["tool_call_id"])
        out.append(m)
    return out


def fallback_messages(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat | None = None) -> list[dict]:
    """The conversation for a template that knows nothing of tools."""
    fmt = fmt or Hermes()
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            text = fmt.write(_pairs(m["tool_calls"]))
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = TOOLS_FALLBACK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
                                        instructions=fmt.instructions())
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None, limits=None, options=None,
                fmt: ToolFormat | None = None) -> list[int]:
    """Token ids of the conversation with the generation prompt, through the model's chat template. options:
    vLLM's `chat_template_kwargs` (the template's own variables), `add_generation_prompt` and
    `continue_final_message` (the last assistant message is left open, to be continued). fmt: the model's tool
    format (hermes when not given)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template: use /v1/completions with a plain prompt")
    fmt = fmt or Hermes()
    native = supports_tools(tokenizer)
    convo = template_messages(messages, fmt) if native else fallback_messages(messages, tools, fmt)
    kwargs = {"tools": tools} if native and tools else {}
    kwargs |= _template_options(options or {}, convo)
    try:
        text = tokenizer.apply_chat_template(convo, tokenize=False, **kwargs)
    except Exception as exc:              # the template's own checks (role order, ...) reject the conversation
        raise APIError(f"the chat template rejected the messages: {type(exc).__name__}: {exc}",
                       param="messages") from exc
    if limits is not None:
        limits.check_prompt(text)
    return tokenizer.encode(text, add_special_tokens=bool((options or {}).get("add_special_tokens")))


def template_options(req) -> dict:
    """A chat request's options for its template (chat_prompt's `options`); add_special_tokens: the tokenizer's
    own BOS / EOS around the templated text too (vLLM's, off by default: templates write their own)."""
    given = req.model_fields_set
    return {"chat_template_kwargs": req.chat_template_kwargs, "continue_final_message": req.continue_final_message,
            "add_generation_prompt": req.add_generation_prompt if "add_generation_prompt" in given else None,
            "add_special_tokens": req.add_special_tokens}


_RESERVED = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message")


def _template_options(options: dict, convo: list[dict]) -> dict:
    extra = options.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise APIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    taken = [k for k in extra if k in _RESERVED]
    if taken:
        raise APIError(f"chat_template_kwargs cannot set {taken[0]!r}", param="chat_template_kwargs")
    cont = bool(options.get("continue_final_message", False))
    asked = options.get("add_generation_prompt")          # None: not given (the default: True)
    if cont and asked is True:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    if cont and (not convo or convo[-1].get("role") != "assistant"):
        raise APIError("continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    gen = (asked is not False) and not cont
    return dict(extra) | {"add_generation_prompt": gen, "continue_final_message": cont}
