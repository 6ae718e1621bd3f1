"""Tool calls out of the model's text (``serve/openai/tools.py``): tagged Hermes calls, bare call objects naming the
request's functions, text that only looks like them; streamed in any split, the same calls and content as whole."""
from __future__ import annotations

import json

import pytest

from ssd_trt.errors import RequestError
from ssd_trt.serve.openai.tools import CallStream, parse_calls, tool_use

NAMES = frozenset({"get_weather", "add"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
CASES = {
    "tagged": (f"<tool_call>\n{WEATHER}\n</tool_call>", None, ["get_weather"]),
    "text then two calls": (f"Let me see.<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{ADD}</tool_call>",
                            "Let me see.", ["get_weather", "add"]),
    "bare": (WEATHER, None, ["get_weather"]),
    "fenced list": (f"```json\n[{WEATHER}, {ADD}]\n```", None, ["get_weather", "add"]),
    "bare, unknown function": ('{"name": "fly", "arguments": {}}', '{"name": "fly", "arguments": {}}', []),
    "plain JSON answer": ('{"city": "Paris"}', '{"city": "Paris"}', []),
    "broken tagged block": ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    "plain text": ("It is sunny < 30 C in Paris.", "It is sunny < 30 C in Paris.", []),
    "unclosed tag": ("Sure <tool_call>{\"name\": \"add\"", "Sure <tool_call>{\"name\": \"add\"", []),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_calls_and_content_whole_and_streamed_in_every_split(case):
    text, content, names = CASES[case]
    whole = parse_calls(text, NAMES)
    assert whole.content == content and [c["function"]["name"] for c in whole.calls] == names
    for call in whole.calls:
        assert call["id"].startswith("call_") and isinstance(json.loads(call["function"]["arguments"]), dict)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut]] + list(text[cut:])):
            stream, sent, calls = CallStream(NAMES), "", []
            for piece in pieces[:-1]:
                more, ready = stream.feed(piece)
                sent, calls = sent + more, calls + ready
            more, ready = stream.end(pieces[-1])
            sent, calls = sent + more, calls + ready
            assert (sent.strip() or None) == content, (case, cut)
            assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
                [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(whole.calls)]


def test_tool_choice_forms_and_their_refusals():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert tool_use({"tools": tools}).choice == "auto" and tool_use({"tools": tools}).grammar() is None
    assert tool_use({"tools": tools, "tool_choice": "none"}) is None
    named = tool_use({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert named.choice == "add" and not named.parallel and "%json" in named.grammar().source
    assert "block)*" in tool_use({"tools": tools, "tool_choice": "required"}).grammar().source
    assert "block)*" not in tool_use({"tools": tools, "tool_choice": "required",
                                      "parallel_tool_calls": False}).grammar().source
    for body, field in [({"tool_choice": "required"}, "tool_choice"), ({"tools": {"a": 1}}, "tools"),
                        ({"tools": tools + tools}, "tools"), ({"tools": tools, "tool_choice": "maybe"}, "tool_choice"),
                        ({"tools": tools, "parallel_tool_calls": "yes"}, "parallel_tool_calls")]:
        with pytest.raises(RequestError) as caught:
            tool_use(body)
        assert caught.value.field == field, body
