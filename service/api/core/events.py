"""A choice's output as typed events, the same for every API: what an encoder turns into its wire format.

    TextDelta         text the answer shows (content; never a tool call's text)
    ToolCallStarted   a tool call begins: its id and function name
    ToolArgsDelta     more of the open call's arguments (JSON text, as the model writes it)
    Finished          the choice ended: its reason in OpenAI's chat terms (the tool plan applied), and the engine's

An encoder never parses a chat message or a tool call's text: `OutputTranslator`
(service/api/core/translator.py) has already, once per choice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TextDelta:
    index: int  # the choice
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgsDelta:
    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class Finished:
    index: int
    reason: str  # "stop" | "length" | "tool_calls" (auto or required made calls) | "abort"
    engine_reason: str  # the engine's finish reason: "stop" | "length" | "abort"
    stop_reason: int | str | None  # the stop string or token id that ended it (engine_reason "stop")
    num_tool_calls: int


OutputEvent = TextDelta | ToolCallStarted | ToolArgsDelta | Finished
