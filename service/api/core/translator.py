"""Choice deltas -> typed output events (service/api/core/events.py), the tool call parser run here, once per choice."""

from __future__ import annotations

from service.api.core.events import Finished, OutputEvent, TextDelta, ToolArgsDelta, ToolCallStarted
from service.api.tools import ToolPlan
from service.streams import ChoiceDelta


class WholeOutput:
    """A choice's events gathered: its text, its tool calls ([id, name, arguments]) and how it ended."""

    def __init__(self, events: list[OutputEvent]) -> None:
        self.text = ""
        self.calls: list[list[str]] = []
        self.finished: Finished | None = None
        for event in events:
            if isinstance(event, TextDelta):
                self.text += event.text
            elif isinstance(event, ToolCallStarted):
                self.calls.append([event.call_id, event.name, ""])
            elif isinstance(event, ToolArgsDelta):
                self.calls[-1][2] += event.arguments
            else:
                self.finished = event


class OutputTranslator:
    """Per choice, its text through the request's tool plan (None: the text is all content), as events."""

    def __init__(self, tool_plan: ToolPlan | None) -> None:
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.choice != "none" else None
        self._parsers: dict = {}  # choice index -> its tool_parsers.ToolCallParser

    def events(self, index: int, delta: ChoiceDelta) -> list[OutputEvent]:
        """What choice `index` gained in `delta`, in order: text, calls started and their arguments, then its end."""
        events: list[OutputEvent] = []
        plan = self.tool_plan
        finish_reason = delta.finish_reason
        num_calls = 0
        if plan is None:
            if delta.text:
                events.append(TextDelta(index, delta.text))
        else:
            parser = self._parsers.get(index)
            if parser is None:
                parser = self._parsers[index] = plan.new_parser()
            content, calls = plan.read_calls(parser, delta.text, finish_reason is not None)
            if content:
                events.append(TextDelta(index, content))
            for call in calls:
                if "id" in call:
                    events.append(ToolCallStarted(index, call["id"], call["function"]["name"]))
                arguments = call.get("function", {}).get("arguments")
                if arguments:
                    events.append(ToolArgsDelta(index, arguments))
            num_calls = len(parser.calls)
            finish_reason = plan.finish_reason(finish_reason, num_calls)
        if finish_reason is not None:
            events.append(Finished(index, finish_reason, delta.finish_reason, delta.stop_reason, num_calls))
        return events
