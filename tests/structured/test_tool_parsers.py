"""Tool call parsers: whole text and the same text cut anywhere give the same calls and content."""

from __future__ import annotations

import json

import pytest

from service.api.tool_parsers import ArgumentsParser, HermesParser, JsonArrayParser, Llama3JsonParser


def _run(parser, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """(content, whole calls, streamed calls rebuilt from the deltas)."""
    content, deltas = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content += text
        deltas += new
    text, new = parser.finish()
    content += text
    deltas += new
    rebuilt: dict[int, dict] = {}
    for delta in deltas:
        call = rebuilt.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in delta:
            assert call["id"] is None and delta["function"]["arguments"] == ""  # id and name come first, once
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"].get("arguments", "")
    streamed = [{"id": c["id"], "name": c["name"], "arguments": c["arguments"]} for _, c in sorted(rebuilt.items())]
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in parser.calls]
    return content, calls, streamed


def _splits(text: str):
    yield [text]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    yield list(text)


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>{"arguments": {"q": "a\\"}b"}, "name": "search"}</tool_call> done')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Oslo", "n": 3}}; {"name": "noop", "parameters": {}}'
ARRAY = '[{"name":"get_weather","arguments":{"city":"Rome","unit":"c"}},{"name":"noop","arguments":{}}]'


@pytest.mark.parametrize("make, text, content, expected", [
    (HermesParser, HERMES, "Let me check. \n done",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("search", {"q": 'a"}b'})]),
    (HermesParser, "no calls here, just <tool text", "no calls here, just <tool text", []),
    (Llama3JsonParser, LLAMA, "", [("get_weather", {"city": "Oslo", "n": 3}), ("noop", {})]),
    (Llama3JsonParser, "  It is sunny {not a call}", "  It is sunny {not a call}", []),
    (JsonArrayParser, ARRAY, "", [("get_weather", {"city": "Rome", "unit": "c"}), ("noop", {})]),
])
def test_every_cut_gives_the_same_calls(make, text, content, expected):
    for pieces in _splits(text):
        got_content, calls, streamed = _run(make(), pieces)
        assert got_content == content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected, pieces
        assert streamed == calls, pieces
        assert len({c["id"] for c in calls}) == len(calls)


def test_arguments_before_the_name_are_sent_with_it():
    # Hermes' second call above writes its arguments first: they reach the client after the name
    _, calls, streamed = _run(HermesParser(), list(HERMES))
    assert calls[1]["name"] == "search" and json.loads(streamed[1]["arguments"]) == {"q": 'a"}b'}


def test_a_named_function_streams_its_arguments_as_they_come():
    parser = ArgumentsParser("lookup")
    _, first = parser.feed("")
    assert first == [{"index": 0, "id": parser.calls[0]["id"], "type": "function",
                      "function": {"name": "lookup", "arguments": ""}}]
    _, second = parser.feed('{"k": ')
    assert second == [{"index": 0, "function": {"arguments": '{"k": '}}]
    parser.feed("1}")
    assert parser.calls[0]["function"]["arguments"] == '{"k": 1}'


def test_a_truncated_call_keeps_what_arrived():
    content, calls, _ = _run(HermesParser(), ['<tool_call>{"name": "f", "arguments": {"a": [1, 2'])
    assert content == "" and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": [1, 2'


def test_the_call_format_is_read_from_the_template():
    from service.api.tools import template_format

    assert template_format(None) == "hermes"
    assert template_format("... <tool_call>{{ tool | tojson }}</tool_call> ... \"parameters\"") == "hermes"
    assert template_format("{{- '<|python_tag|>' }} ... {\"name\": ..., \"parameters\": ...}") == "llama3_json"
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"


NAMES = ["get_weather", "search", "noop"]


@pytest.mark.parametrize("make, text, content, expected", [
    # plain JSON, not a call: the answer stays content
    (Llama3JsonParser, '{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),
    (Llama3JsonParser, '{"name": "Paris", "population": 2}', '{"name": "Paris", "population": 2}', []),
    (Llama3JsonParser, '{"name": "noop", "parameters": {}} and that is all', " and that is all",
     [("noop", {})]),
    # a block that is not a call is content; one missing its last brace still ends at its tag
    (HermesParser, "<tool_call>oops</tool_call> then text", "<tool_call>oops</tool_call> then text", []),
    (HermesParser, '<tool_call>{"name": "search", "arguments": {"query": "a"}</tool_call>'
                   '<tool_call>{"name": "noop", "arguments": {}}</tool_call>', "",
     [("search", {"query": "a"}), ("noop", {})]),
    (HermesParser, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>ok',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>ok', []),
    (HermesParser, '<tool_call>{"name": "search", "arguments": {"query": "</tool_call>"}}</tool_call>', "",
     [("search", {"query": "</tool_call>"})]),
    # escapes in keys, and arguments written as a JSON string
    (HermesParser, '<tool_call>{"x\\\\": 1, "name": "noop", "arguments": "{\\"a\\": 1}"}</tool_call>', "",
     [("noop", {"a": 1})]),
])
def test_malformed_and_foreign_output_stays_content(make, text, content, expected):
    for pieces in _splits(text):
        got_content, calls, streamed = _run(make(NAMES), pieces)
        assert got_content == content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected, pieces
        assert streamed == calls, pieces


def test_a_truncated_block_without_a_name_is_content():
    content, calls, _ = _run(HermesParser(NAMES), ['Hi <tool_call>{"argu'])
    assert content == 'Hi <tool_call>{"argu' and calls == []
