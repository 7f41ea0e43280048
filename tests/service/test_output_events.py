"""service/api/core: a choice's deltas become typed output events, the tool call parser run once, whatever the API."""

import pytest

from service.api.core.events import Finished, TextDelta, ToolArgsDelta, ToolCallStarted
from service.api.core.translator import OutputTranslator, WholeOutput
from service.api.tools import ToolPlan
from service.streams import ChoiceDelta

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def delta(text: str, finish_reason: str | None = None, stop_reason=None, index: int = 0) -> ChoiceDelta:
    out = ChoiceDelta(index)
    out.text, out.finish_reason, out.stop_reason = text, finish_reason, stop_reason
    return out


def plan(choice: str) -> ToolPlan:
    return ToolPlan([WEATHER], choice, "get_weather" if choice == "function" else None, True, "hermes")


def test_without_tools_the_text_is_the_answer_and_the_end_carries_the_engines_reasons():
    translator = OutputTranslator(None)
    assert translator.events(0, delta("Hello")) == [TextDelta(0, "Hello")]
    assert translator.events(0, delta("", "stop", "END")) == [Finished(0, "stop", "stop", "END", 0)]
    assert translator.events(1, delta(" there", "length", index=1)) == [TextDelta(1, " there"),
                                                                        Finished(1, "length", "length", None, 0)]


def test_a_hermes_call_split_across_deltas_is_one_call_started_then_its_arguments():
    translator = OutputTranslator(plan("auto"))
    events = []
    for piece in ["Let me check. <tool", '_call>{"name": "get_weather", "argu', 'ments": {"city": "Paris"}}</tool_call>']:
        events += translator.events(0, delta(piece))
    events += translator.events(0, delta("", "stop"))
    assert events[0] == TextDelta(0, "Let me check. ")
    started = [e for e in events if isinstance(e, ToolCallStarted)]
    assert len(started) == 1 and started[0].name == "get_weather" and started[0].call_id
    arguments = "".join(e.arguments for e in events if isinstance(e, ToolArgsDelta))
    assert arguments.replace(" ", "") == '{"city":"Paris"}'
    assert events[-1] == Finished(0, "tool_calls", "stop", None, 1)  # auto made a call: OpenAI's "tool_calls"
    assert not any(isinstance(e, TextDelta) for e in events[1:])  # the call's own text is never shown


@pytest.mark.parametrize("choice", ["required", "function"])
def test_a_constrained_tool_choice_shows_no_text_and_the_whole_output_gathers_the_call(choice):
    text = ('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]' if choice == "required"
            else '{"city": "Oslo"}')
    whole = WholeOutput(OutputTranslator(plan(choice)).events(0, delta(text, "stop")))
    assert whole.text == ""
    [(call_id, name, arguments)] = whole.calls
    assert call_id and name == "get_weather" and arguments.replace(" ", "") == '{"city":"Oslo"}'
    # a named function ends "stop" in chat terms (OpenAI's), required ends "tool_calls"
    assert whole.finished == Finished(0, "stop" if choice == "function" else "tool_calls", "stop", None, 1)


def test_a_choice_that_never_ends_has_no_finished_event():
    whole = WholeOutput(OutputTranslator(plan("auto")).events(0, delta("plain words")))
    assert whole.finished is None and whole.calls == [] and whole.text == "plain words"


def test_chat_encodes_the_events_as_openai_deltas_and_a_final_message():
    from runtime.tokenizer import ByteTokenizer
    from service.api.formatting import ChatFormat

    pieces = ["Sure. <tool_call>", '{"name": "get_weather", "arguments": {"city": "Rome"}}', "</tool_call>", ""]
    fmt = ChatFormat("chatcmpl-1", 0, "m", ByteTokenizer(), None, tool_plan=plan("auto"))
    chunks = [fmt.delta_choice(0, delta(piece, "stop" if i == len(pieces) - 1 else None), first=i == 0)
              for i, piece in enumerate(pieces)]
    assert chunks[0]["delta"] == {"role": "assistant", "content": "Sure. ", "refusal": None}
    calls = [call for chunk in chunks for call in chunk["delta"].get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(call) == {"index", "function"} and call["index"] == 0 for call in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls[1:]).replace(" ", "") == '{"city":"Rome"}'
    assert [c["delta"]["content"] for c in chunks[1:]] == [None, None, None]  # calls only: OpenAI's null
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "tool_calls"]
    whole = delta("".join(pieces), "stop")
    final = ChatFormat("chatcmpl-2", 0, "m", ByteTokenizer(), None, tool_plan=plan("auto")).final_choice(0, whole)
    [call] = final["message"]["tool_calls"]
    assert final["message"]["content"] == "Sure. " and final["finish_reason"] == "tool_calls"
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    assert call["function"]["arguments"].replace(" ", "") == '{"city":"Rome"}'
