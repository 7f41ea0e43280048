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
    llama3_json  an output that starts with a call, {"name": ..., "parameters": {...}}, is calls
                 separated by `;` (Llama 3.1 / 3.2 / 3.3); any other output is content

In the two free formats only an object naming one of the request's functions is a call;
anything else (plain JSON, a malformed block, another name) stays content, as written.
Arguments the model wrote as a JSON string ("arguments": "{\"a\": 1}") are that string's
text, sent whole once it ends.
    json_array   [{"name": ..., "arguments": {...}}, ...] (tool_choice "required": constrained)
    arguments    the whole output is one named function's arguments (a named tool_choice)
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

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
            if char == '"' and _unescaped_quote(self.raw):
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
        if self.key in ARGUMENT_KEYS and value.kind == "string":  # arguments sent as JSON text: held, then decoded
            self.raw += char
            if complete:
                new_arguments = _decode_string(self.raw)
                self.arguments += new_arguments
        elif self.key in ARGUMENT_KEYS:
            self.arguments += char
            new_arguments = char
        elif self.key == "name":
            self.raw += char
        if complete:
            return self._end_value(), new_arguments
        return None, new_arguments

    @property
    def in_string(self) -> bool:
        """Inside a key or a string value (where a close tag is text, not the end of the block)."""
        return self.state == "in_key" or (self.state == "value" and self.value.in_string)

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


def _unescaped_quote(raw: str) -> bool:
    """True if the quote that ends `raw` is not escaped (an even run of backslashes before it)."""
    run = len(raw) - 1 - len(raw[:-1].rstrip("\\"))
    return run % 2 == 0


def _decode_string(raw: str) -> str:
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.strip('"')
    return value if isinstance(value, str) else str(value)


class ToolCallParser:
    """Shared bookkeeping: the calls so far and the deltas they produce.

    With `names` (the request's functions), an object whose name is not one of them is not a
    call: its text is content. So is an object that closes without a name.
    """

    def __init__(self, names: Collection[str] | None = None) -> None:
        self.names = set(names) if names is not None else None
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

    def _feed_object(self, char: str, deltas: list[dict]) -> str:
        """One character into the current call object: "open", "closed" (a call ended) or "rejected" (not a call)."""
        obj = self._object
        name, arguments = obj.feed(char)
        if name is not None:
            if self.names is not None and name not in self.names:
                self._object = None
                return "rejected"
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
            return "closed" if obj.name is not None else "rejected"
        return "open"

    def _feed_calls(self, char: str, deltas: list[dict]) -> str:
        """A character of `call, call, ...` text: into the open call, or "{" opens the next; else "outside"."""
        if self._object is not None:
            return self._feed_object(char, deltas)
        if char == "{":
            self._start_call()
            return self._feed_object(char, deltas)
        return "outside"

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
            if self._opened:
                self._feed_calls(char, deltas)
            else:
                self._opened = char == "["
        return "", deltas


class HermesParser(ToolCallParser):
    """Content with `<tool_call>{...}</tool_call>` blocks in it.

    A block that holds no call of a known function (not JSON, no name, another name) is
    content, as written; a block whose object lacks its last brace ends at its close tag.
    """

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__(names)
        self._held = ""  # text that may be the start of an open tag
        self._block: str | None = None  # the current block's text after its open tag, None outside blocks
        self._calls_before = 0  # calls made before the current block

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = [], []
        text = self._held + text
        self._held = ""
        i = 0
        while i < len(text):
            if self._block is None:
                start = text.find(self.OPEN, i)
                if start < 0:
                    held = _partial_suffix(text[i:], self.OPEN)
                    content.append(text[i : len(text) - len(held)])
                    self._held = held
                    break
                content.append(text[i:start])
                i, self._block, self._calls_before = start + len(self.OPEN), "", len(self.calls)
                self._start_call()
                continue
            char = text[i]
            i += 1
            self._block += char
            if self._object is not None:
                self._feed_object(char, deltas)
            if self._block.endswith(self.CLOSE) and not (self._object is not None and self._object.in_string):
                content.append(self._end_block())
        out = "".join(content)
        self.content += out
        return out, deltas

    def _end_block(self) -> str:
        """Close the current block: "" if it made a call, else its text (it was content)."""
        block, self._block, self._object = self._block, None, None
        return "" if len(self.calls) > self._calls_before else self.OPEN + block

    def finish(self) -> tuple[str, list[dict]]:
        tail = self._end_block() if self._block is not None else self._held
        self._held = ""
        self.content += tail
        return tail, []


class Llama3JsonParser(ToolCallParser):
    """An output that starts with a call object is `;`-separated calls; any other output is content.

    Text is held until the first object names a known function; an object that does not, and
    any text after the calls that is not another call, turn the rest into content.
    """

    def __init__(self, names: Collection[str] | None = None) -> None:
        super().__init__(names)
        self._content_mode = False
        self._held = ""  # text not yet known to be calls or content

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = [], []
        for i, char in enumerate(text):
            if self._content_mode:
                content.append(text[i:])
                break
            if self._object is None or self._object.name is None:
                self._held += char
            status = self._feed_calls(char, deltas)
            if self._object is not None and self._object.name is not None:
                self._held = ""  # committed: a call of a known function
            if status == "rejected" or (status == "outside" and char not in WHITESPACE and char != ";"):
                self._content_mode = True
                content.append(self._held)
                self._held = ""
            elif status == "closed":
                self._held = ""
        out = "".join(content)
        self.content += out
        return out, deltas

    def finish(self) -> tuple[str, list[dict]]:
        held, self._held = self._held, ""
        if self.calls and not held.strip(WHITESPACE + ";"):
            held = ""  # separators after the last call
        self.content += held
        return held, []


def _partial_suffix(text: str, tag: str) -> str:
    """The longest end of `text` that is a start of `tag` (held back until the next delta)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[-size:]
    return ""


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
