"""runtime/json_limits.py: depth measured on the text (the json module's own parse is the reference), sizes counted."""

import json

import msgspec
import pytest

from runtime.errors import InvalidRequestError
from runtime.json_limits import MAX_JSON_DEPTH, check_json_depth, check_schema_size, count_json_values, decode_json, \
    json_depth


def _reference_depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_reference_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_reference_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize("text", [
    '1', '"x"', '[]', '{}', '[[], [[]], {"a": [{}]}]',
    '{"a": "[[[{{{", "b": ["]]]", "}}"]}',  # brackets inside strings do not count
    '["\\"[[[", "\\\\", [["\\\\\\"]]"]]]',  # escaped quotes and backslashes before a closing quote
    '{"k[": {"k{": [1, 2, {"x": null}]}}',  # brackets in keys
    '["\u00e9\u4e2d[", {"\U0001f642": [[[]]]}]',  # non-ASCII inside strings
])
def test_depth_matches_the_parsed_value(text):
    assert json_depth(text) == _reference_depth(json.loads(text))
    assert json_depth(text.encode()) == _reference_depth(json.loads(text))


def test_a_body_one_level_past_the_limit_is_refused_naming_the_code():
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    check_json_depth(at_limit)
    with pytest.raises(InvalidRequestError) as raised:
        check_json_depth("[" + at_limit + "]", param="tools")
    assert raised.value.code == "json_too_deep" and raised.value.param == "tools"
    assert f"{MAX_JSON_DEPTH + 1} levels" in raised.value.message


def test_many_brackets_inside_one_string_are_no_depth():
    text = json.dumps({"prompt": "[{" * 100_000})
    check_json_depth(text)
    assert json_depth(text) == 1


def test_decode_json_never_reaches_the_parsers_recursion_limit():
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    with pytest.raises(RecursionError):
        msgspec.json.decode(deep)  # what the check is for
    with pytest.raises(InvalidRequestError):
        decode_json(deep)
    assert decode_json(b'{"a": [1, 2]}') == {"a": [1, 2]}


def test_values_are_counted_with_keys_and_stop_early():
    assert count_json_values({"a": [1, 2], "b": {"c": None}}, 100) == 9  # 2 objects, 1 array, 3 keys, 3 scalars
    assert count_json_values(list(range(1_000_000)), 10) == 11  # stops counting once past the limit


def test_a_schema_past_the_value_limit_is_refused():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10)}}
    check_schema_size(schema, "response_format", max_values=100)
    with pytest.raises(InvalidRequestError) as raised:
        check_schema_size(schema, "response_format", max_values=20)
    assert raised.value.code == "schema_too_large" and raised.value.param == "response_format"
