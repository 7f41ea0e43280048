"""Model output text -> OpenAI tool calls, incrementally: one parser per choice, fed each text delta.

    parser.feed(text)  -> (content text, [tool call delta, ...])   as the text arrives
    parser.finish()    -> the same, for whatever was held back
    parser.calls       -> the whole calls so far, for a non-streamed message

A tool call delta is OpenAI's streamed shape: the first for a call carries its index, id,
type and name (arguments ""), the later ones argument fragments ({"index", "function":
{"arguments"}}). Arguments are the model's own text of the arguments value, so the
fragments joined are exactly the call's `arguments`.

Formats (which one a model gets: service/api/tools.py):
    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text around
                 them is content (Hermes 2 Pro, Qwen2.5, Qwen3)
    llama3_json  an output that starts with `{` is calls: {"name": ..., "parameters": {...}},
                 separated by `;` (Llama 3.1 / 3.2 / 3.3); any other output is content
    json_array   [{"name": ..., "arguments": {...}}, ...] (tool_choice "required": constrained)
    arguments    the whole output is one named function's arguments (a named tool_choice)
"""

from __future__ import annotations

import uuid

import msgspec

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _ValueEnd:
    """Tracks one JSON value character by character; says when it has ended."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.kind = ""  # "string", "container" or "scalar", from its first character

    def ends_before(self, char: str) -> bool:
        """True if a scalar value ended just before `char` (which is not part of it)."""
        return self.kind == "scalar" and (char in ",}]" or char in WHITESPACE)

    def take(self, char: str) -> bool:
        """Consume `char` (part of the value); True if the value is complete with it."""
        if not self.kind:
            self.kind = "string" if char == '"' else "container" if char in "{[" else "scalar"
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                return self.kind == "string"
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class _CallObject:
    """Reads one `{"name": "...", "arguments": VALUE, ...}` object; reports the name and argument text."""

    def __init__(self) -> None:
        self.state = "open"
        self.key = ""
        self.raw = ""  # the key or the name string being read, raw JSON
        self.value: _ValueEnd | None = None
        self.name: str | None = None
        self.arguments = ""
        self.done = False

    def feed(self, char: str) -> tuple[str | None, str]:
        """Consume one character: (the name if it just completed, new argument text)."""
        state = self.state
        if state == "open":
            if char == "{":
                self.state = "key"
            return None, ""
        if state == "key":
            if char == '"':
                self.state, self.raw = "in_key", '"'
            elif char == "}":
                self.state, self.done = "done", True
            return None, ""
        if state == "in_key":
            self.raw += char
            if char == '"' and not self.raw.endswith('\\"'):
                self.key, self.state = _decode_string(self.raw), "colon"
            return None, ""
        if state == "colon":
            if char == ":":
                self.state = "value_start"
            return None, ""
        if state == "value_start":
            if char in WHITESPACE:
                return None, ""
            self.state, self.value, self.raw = "value", _ValueEnd(), ""
        value = self.value
        if value.ends_before(char):  # a scalar ended: this character belongs to the object
            name = self._end_value()
            return (name, "") if char in WHITESPACE or char == "," else self._after_value(name, char)
        complete = value.take(char)
        new_arguments = ""
        if self.key in ARGUMENT_KEYS:
            self.arguments += char
            new_arguments = char
        elif self.key == "name":
            self.raw += char
        if complete:
            return self._end_value(), new_arguments
        return None, new_arguments

    def _after_value(self, name: str | None, char: str) -> tuple[str | None, str]:
        if char == "}":
            self.state, self.done = "done", True
        return name, ""

    def _end_value(self) -> str | None:
        self.state = "key"
        if self.key == "name" and self.name is None:
            self.name = _decode_string(self.raw)
            return self.name
        return None


def _decode_string(raw: str) -> str:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.strip('"')
    return value if isinstance(value, str) else str(value)


class ToolCallParser:
    """Shared bookkeeping: the calls so far and the deltas they produce."""

    def __init__(self) -> None:
        self.calls: list[dict] = []  # OpenAI's message.tool_calls entries, growing
        self.content = ""  # the text that is not calls
        self._object: _CallObject | None = None
        self._pending_arguments = ""  # arguments that came before the name (sent with it)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        return "", []

    def _start_call(self) -> None:
        self._object = _CallObject()
        self._pending_arguments = ""

    def _feed_object(self, char: str, deltas: list[dict]) -> bool:
        """One character into the current call object; True once the object has closed."""
        obj = self._object
        name, arguments = obj.feed(char)
        if name is not None:
            call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
            self.calls.append(call)
            deltas.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                           "function": {"name": name, "arguments": ""}})
            arguments, self._pending_arguments = self._pending_arguments + arguments, ""
        if arguments:
            if obj.name is None:
                self._pending_arguments += arguments
            else:
                self._add_arguments(arguments, deltas)
        if obj.done:
            self._object = None
            return True
        return False

    def _add_arguments(self, text: str, deltas: list[dict]) -> None:
        self.calls[-1]["function"]["arguments"] += text
        index = len(self.calls) - 1
        if deltas and deltas[-1]["index"] == index and "id" not in deltas[-1]:  # merge this feed's fragments
            deltas[-1]["function"]["arguments"] += text
        else:
            deltas.append({"index": index, "function": {"arguments": text}})


class ArgumentsParser(ToolCallParser):
    """The whole output is the arguments of one known function (a named tool_choice)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> tuple[str, list[dict]]:
        deltas: list[dict] = []
        if not self.calls:
            call = {"id": new_call_id(), "type": "function", "function": {"name": self.name, "arguments": ""}}
            self.calls.append(call)
            deltas.append({"index": 0, "id": call["id"], "type": "function",
                           "function": {"name": self.name, "arguments": ""}})
        if text:
            self._add_arguments(text, deltas)
        return "", deltas


class JsonArrayParser(ToolCallParser):
    """`[call, call, ...]`: the constrained output of tool_choice "required"."""

    def __init__(self) -> None:
        super().__init__()
        self._opened = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        deltas: list[dict] = []
        for char in text:
            if self._object is not None:
                self._feed_object(char, deltas)
            elif not self._opened:
                self._opened = char == "["
            elif char == "{":
                self._start_call()
                self._feed_object(char, deltas)
        return "", deltas


class HermesParser(ToolCallParser):
    """Content with `<tool_call>{...}</tool_call>` blocks in it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # text that may be the start of a tag
        self._in_call = False
        self._closing = False  # the object ended: skipping to the close tag

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = [], []
        text = self._held + text
        self._held = ""
        i = 0
        while i < len(text):
            if self._in_call:
                if self._closing:
                    end = text.find(self.CLOSE, i)
                    if end < 0:
                        self._held = _partial_suffix(text[i:], self.CLOSE)
                        break
                    i, self._in_call, self._closing = end + len(self.CLOSE), False, False
                    continue
                if self._feed_object(text[i], deltas):
                    self._closing = True
                i += 1
                continue
            start = text.find(self.OPEN, i)
            if start < 0:
                held = _partial_suffix(text[i:], self.OPEN)
                content.append(text[i : len(text) - len(held)])
                self._held = held
                break
            content.append(text[i:start])
            i, self._in_call = start + len(self.OPEN), True
            self._start_call()
        out = "".join(content)
        self.content += out
        return out, deltas

    def finish(self) -> tuple[str, list[dict]]:
        held, self._held = ("", "") if self._in_call else (self._held, "")
        self.content += held
        return held, []


class Llama3JsonParser(ToolCallParser):
    """An output that starts with `{` is `;`-separated calls; anything else is content."""

    def __init__(self) -> None:
        super().__init__()
        self._mode = ""  # "", "calls" or "content"
        self._leading = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        deltas: list[dict] = []
        if self._mode == "":
            self._leading += text
            stripped = self._leading.lstrip(WHITESPACE)
            if not stripped:
                return "", deltas
            self._mode = "calls" if stripped.startswith("{") else "content"
            text, self._leading = (stripped if self._mode == "calls" else self._leading), ""
        if self._mode == "content":
            self.content += text
            return text, deltas
        for char in text:
            if self._object is not None:
                self._feed_object(char, deltas)
            elif char == "{":
                self._start_call()
                self._feed_object(char, deltas)
        return "", deltas

    def finish(self) -> tuple[str, list[dict]]:
        leading, self._leading = self._leading, ""
        self.content += leading
        return leading, []


def _partial_suffix(text: str, tag: str) -> str:
    """The longest end of `text` that is a start of `tag` (held back until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[-size:]
    return ""


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
