"""How deep JSON from a caller may nest, checked on the text before anything parses it.

A parser that recurses (msgspec's, the json module's, a schema compiler, a template's
tojson) fails on a few thousand levels with RecursionError, and Python code that walks the
result may fail on fewer. Every JSON text a caller hands us is scanned first: a request body,
a WebSocket frame, a schema or tool-call arguments given as a string. The scan is linear and
runs in C but for one step per bracket: strings are cut out by a regular expression, then the
brackets left are counted.

    {"a": [1, {"b": "[[["}]}      ->  {[{}]}   ->  depth 3
"""

from __future__ import annotations

import re
from itertools import accumulate

import msgspec

from runtime.errors import InvalidRequestError

MAX_JSON_DEPTH = 64  # objects and arrays inside one another; OpenAI's schemas allow 10 levels, bodies a few more

# a JSON string, escapes included (the unrolled form: no backtracking)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(_BRACKETS)))
_STEP = [0] * 256  # +1 for an opening bracket, -1 for a closing one
for _byte in b"[{":
    _STEP[_byte] = 1
for _byte in b"]}":
    _STEP[_byte] = -1


def json_depth(text: bytes | str) -> int:
    """How deep the objects and arrays of a JSON text nest (0 for a scalar). Malformed text gets a
    number too: the parser then says what is wrong."""
    raw = text.encode() if isinstance(text, str) else text
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets), initial=0))


def check_json_depth(text: bytes | str, param: str | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
    """InvalidRequestError (code json_too_deep, naming `param`) if the text nests deeper than `max_depth`."""
    raw = text.encode() if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # cannot nest deeper than it has brackets
        return
    depth = json_depth(raw)
    if depth > max_depth:
        where = f"{param} " if param else ""
        raise InvalidRequestError(f"the JSON {where}nests {depth} levels deep; the limit is {max_depth}",
                                  param=param, code="json_too_deep")


def decode_json(text: bytes | str, param: str | None = None, max_depth: int = MAX_JSON_DEPTH, *,
                type=None):  # noqa: A002 (msgspec's own name)
    """msgspec.json.decode (strictly into `type`, if given), after the depth check: it can raise
    msgspec.DecodeError or ValidationError, never RecursionError."""
    check_json_depth(text, param, max_depth)
    return msgspec.json.decode(text) if type is None else msgspec.json.decode(text, type=type, strict=True)


MAX_SCHEMA_VALUES = 20_000  # values in one schema (~5,000 properties, OpenAI's limit); compiling grows faster than that


def count_json_values(value, stop_after: int) -> int:
    """Objects, arrays and scalars in a decoded JSON value, counting no further than `stop_after` + 1."""
    count, stack = 0, [value]
    while stack and count <= stop_after:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
            count += len(item)  # the keys
        elif isinstance(item, list):
            stack.extend(item)
    return count


def check_schema_size(schema, param: str | None = None, max_values: int = MAX_SCHEMA_VALUES) -> None:
    """InvalidRequestError (code schema_too_large, naming `param`) for a schema of more than `max_values` values."""
    if count_json_values(schema, max_values) > max_values:
        raise InvalidRequestError(f"the schema has more than {max_values} values (keys, objects, arrays and scalars)",
                                  param=param, code="schema_too_large")
