"""Tool calls on the server's side, without a model: the parser over whole and streamed output, the tool formats
chosen from real chat templates (tests/data/chat_templates), their prompts through the default tokenizer, and their
structural tags checked with xgrammar's matcher on hand-written calls."""
import copy
import json
from pathlib import Path

import pytest

from engine.server.openai.chat import chat_prompt, normalize_messages, supports_tools
from engine.server.openai.tool_formats import PYTHON_TAG, Llama3Json, Mistral, detect, json_end, resolve, template_text
from engine.server.openai.tools import ToolCallParser, plan_tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def run(parser: ToolCallParser, text: str, step: int | None = None) -> tuple[str | None, list[dict]]:
    """(content or None, calls as {name, arguments}) from feeding `text` whole or `step` characters at a time."""
    events = []
    for i in range(0, len(text), step or len(text) or 1):
        events += parser.feed(text[i:i + (step or len(text))])
    events += parser.finish()
    content = "".join(item for kind, item in events if kind == "content")
    calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
             for kind, c in events if kind == "call"]
    return content or None, calls


PARIS = {"name": "get_weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize("step", [None, 1, 3])
@pytest.mark.parametrize("forced", [True, False])
def test_whitespace_before_a_call_is_not_content(step, forced):
    assert run(ToolCallParser(forced=forced), "\n" + CALL, step) == (None, [PARIS])
    assert run(ToolCallParser(forced=forced), " \n" + CALL + "\n\n" + CALL + "\n", step) == (None, [PARIS, PARIS])


@pytest.mark.parametrize("step", [None, 1, 5])
def test_a_forced_output_cut_in_its_second_call_is_the_first_call_only(step):
    cut = CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": { "city": "Paris" }}\n</tool'
    assert run(ToolCallParser(forced=True), cut, step) == (None, [PARIS])
    assert run(ToolCallParser(forced=True), CALL[:20], step) == (None, [])


@pytest.mark.parametrize("step", [None, 1, 4])
def test_auto_keeps_text_and_returns_an_unfinished_call_as_text(step):
    assert run(ToolCallParser(), "Let me check.\n" + CALL + "\nDone.", step) == ("Let me check.\nDone.", [PARIS])
    assert run(ToolCallParser(), "Hello  there, you", step) == ("Hello  there, you", [])
    assert run(ToolCallParser(), "\n\n", step) == ("\n\n", [])      # no call: the text is the answer
    assert run(ToolCallParser(), CALL[:30], step) == (CALL[:30], [])
    assert run(ToolCallParser(), "a <tool_ b", step) == ("a <tool_ b", [])


def test_streamed_whitespace_is_held_until_known():
    parser = ToolCallParser()
    assert parser.feed("\n") == []
    assert parser.feed(" Hi") == [("content", "\n Hi")]
    assert parser.feed(" ") == [("content", " ")]


# --- tool formats from the chat template ------------------------------------------------------------------------

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FORMATS = {"qwen2.5-instruct": "hermes", "llama-3.1-instruct": "llama3_json", "llama-3.2-instruct": "llama3_json",
           "mistral-7b-instruct-v0.3": "mistral"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
# one valid call, as each format writes it, and one whose arguments break the schema
CALLS = {"hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
         "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                         '{"name": "get_weather", "parameters": {"town": "Paris"}}'),
         "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "x": 1}}]')}
TWO = {"hermes": CALLS["hermes"][0] + "\n" + CALLS["hermes"][0].replace("Paris", "Rome"),
       "mistral": CALLS["mistral"][0][:-1] + ', {"name": "get_time", "arguments": {"zone": "CET"}}]'}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tokenizer():
    from engine.models.loader import load_tokenizer, resolve_model
    return load_tokenizer(resolve_model("default"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    from engine.guided.compiler import tokenizer_info
    info = tokenizer_info(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return xgr.GrammarCompiler(info, cache_enabled=False), tokenizer.eos_token_id


def with_template(tokenizer, name: str):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def accepts(compiler, guide: dict, text: str) -> bool:
    """Whether the structural tag takes `text` as a whole output (the grammar may end after it)."""
    import xgrammar as xgr
    compiler, eos = compiler
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(guide)))
    return matcher.accept_string(text) and (matcher.is_terminated() or matcher.accept_token(eos))


@pytest.mark.parametrize("name", FORMATS)
def test_each_template_gives_its_format(tokenizer, name):
    tok = with_template(tokenizer, name)
    assert detect(template_text(tok)) == FORMATS[name] == resolve(tok).name
    assert resolve(tok, "hermes").name == "hermes"
    assert resolve(tokenizer).name == "hermes" and not supports_tools(tokenizer)     # SmolLM2: the fallback
    assert resolve(with_template(tokenizer, "llama-3.1-instruct")).python_tag
    assert not resolve(with_template(tokenizer, "llama-3.2-instruct")).python_tag


def conversation() -> list[dict]:
    return normalize_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0123456789abcdef", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "Sunny, 21 C"}])


@pytest.mark.parametrize("name", FORMATS)
def test_prompts_show_the_tools_and_past_calls_in_the_templates_own_way(tokenizer, name):
    tok = with_template(tokenizer, name)
    fmt = resolve(tok)
    tools = plan_tools(TOOLS, "auto", True, None, fmt).tools
    text = tok.decode(chat_prompt(tok, conversation(), tools, fmt=fmt))
    assert '"get_time"' in text and '"Weather in a city"' in text
    past = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "'}[fmt.name]
    assert past in text
    result = {"hermes": "<tool_response>\nSunny, 21 C\n</tool_response>",
              "llama3_json": 'ipython<|end_header_id|>\n\n"Sunny, 21 C"',
              "mistral": '[TOOL_RESULTS] {"content": Sunny, 21 C, "call_id": "'}[fmt.name]
    assert result in text
    if fmt.name == "mistral":       # OpenAI-style ids become the 9 characters its template takes, the same for both
        call_id = text.split('"id": "')[1][:9]
        assert text.split('"call_id": "')[1][:9] == call_id and call_id.isalnum()


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_the_fallback_prompt_teaches_the_chosen_format(tokenizer, name):
    fmt = resolve(tokenizer, name)
    text = tokenizer.decode(chat_prompt(tokenizer, conversation(), plan_tools(TOOLS, "auto", True).tools, fmt=fmt))
    assert fmt.instructions() in text and fmt.write([("get_weather", {"city": "Paris"})]) in text


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_guided_calls_parse_back_under_each_tool_choice(compiler, name):
    fmt = resolve(None, name)
    good, bad = CALLS[name]
    for choice in ("required", NAMED, "auto"):
        plan = plan_tools(TOOLS, choice, True, None, fmt)
        assert accepts(compiler, plan.guide, good) and not accepts(compiler, plan.guide, bad)
        assert run(plan.parser(), good, 3) == (None, [PARIS])
    auto = plan_tools(TOOLS, "auto", True, None, fmt)
    assert accepts(compiler, auto.guide, "It is sunny.") and run(auto.parser(), "It is sunny.") == ("It is sunny.", [])
    assert accepts(compiler, auto.guide, "Let me look. " + good)
    assert not accepts(compiler, plan_tools(TOOLS, "required", True, None, fmt).guide, "Sure. " + good)
    named_time = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, None, fmt)
    assert not accepts(compiler, named_time.guide, good)


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_parallel_calls_where_the_format_has_them(compiler, name):
    fmt = resolve(None, name)
    two = [PARIS, {"name": "get_weather", "arguments": {"city": "Rome"}}] if name == "hermes" else \
        [PARIS, {"name": "get_time", "arguments": {"zone": "CET"}}]
    assert accepts(compiler, plan_tools(TOOLS, "required", True, None, fmt).guide, TWO[name])
    assert not accepts(compiler, plan_tools(TOOLS, "required", False, None, fmt).guide, TWO[name])
    assert run(ToolCallParser(fmt, forced=True), TWO[name], 2) == (None, two)


def test_llama_takes_one_call_a_turn_and_reads_the_python_tag(compiler):
    fmt = Llama3Json(python_tag=True)
    good = CALLS["llama3_json"][0]
    assert not accepts(compiler, plan_tools(TOOLS, "required", True, None, fmt).guide, good + "; " + good)
    assert run(ToolCallParser(fmt), PYTHON_TAG + good, 1) == (None, [PARIS])
    assert run(ToolCallParser(fmt), '{"name": "Tom", "age": 3}', 2) == ('{"name": "Tom", "age": 3}', [])
    assert run(ToolCallParser(fmt), "Use {braces} here", 2) == ("Use {braces} here", [])


def test_mistral_ids_are_nine_letters_or_digits():
    fmt = Mistral()
    _, [call] = [], [e for e in ToolCallParser(fmt).feed(CALLS["mistral"][0]) if e[0] == "call"]
    assert len(call[1]["id"]) == 9 and call[1]["id"].isalnum()
    assert fmt.history_id("abcDEF123") == "abcDEF123" and fmt.history_id("call_1") == fmt.history_id("call_1")


def test_json_end_skips_brackets_inside_strings():
    text = '{"a": "}]\\"{", "b": [1, {"c": 2}]} tail'
    assert json_end(text, 0) == text.index(" tail") and json_end(text[:20], 0) is None


def test_serve_with_a_chosen_tool_call_parser():
    """The default model (SmolLM2, whose template shows no tool format) told to write Llama 3 JSON calls: the
    fallback prompt teaches that format, and forced calls come back parsed."""
    from serving import CPU_ARGS, api_client, serve
    with serve(*CPU_ARGS, "--single-process", "--max-num-seqs", "2", "--max-model-len", "1024",
               "--tool-call-parser", "llama3_json") as server:
        client = api_client(server.url)
        for choice in ("required", NAMED):
            r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Paris?"}],
                                               tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0)
            [call] = r.choices[0].message.tool_calls
            assert r.choices[0].message.content is None and call.function.name in ("get_weather", "get_time")
            assert call.function.name == "get_weather" or choice == "required"
            json.loads(call.function.arguments)
