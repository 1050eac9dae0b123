"""Tool calls on the server's side, without a model: the parser over whole and streamed output."""
import json

import pytest

from engine.server.tools import ToolCallParser

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
    assert run(ToolCallParser(forced), "\n" + CALL, step) == (None, [PARIS])
    assert run(ToolCallParser(forced), " \n" + CALL + "\n\n" + CALL + "\n", step) == (None, [PARIS, PARIS])


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
