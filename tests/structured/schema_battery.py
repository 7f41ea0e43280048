"""JSON schemas that constrained outputs must validate against (tests and bench/ share them).

Every string, array and number is bounded (a number by its range and `multipleOf`: a range
alone leaves the digits after the point unbounded, and a noise model at temperature 0 may
write zeros until max_tokens), so a noise model reaches the end of its object within the
token budget the tests give; what the battery covers is named in each key.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SHORT = {"type": "string", "maxLength": 6}
SCORE = {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25}  # bounded digits too
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
FLAG = {"type": "boolean"}


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """An object schema that allows no other keys; required defaults to all of them."""
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
            **extra}


SCHEMAS: dict[str, dict] = {
    "one_string": obj({"name": NAME}),
    "one_integer_range": obj({"age": AGE}),
    "one_number_range": obj({"score": SCORE}),
    "one_boolean": obj({"ok": FLAG}),
    "null_value": obj({"nothing": {"type": "null"}}),
    "enum_strings": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "enum_mixed": obj({"level": {"enum": [1, 2, "high", None, True]}}),
    "const": obj({"kind": {"const": "point"}, "x": AGE}),
    "negative_range": obj({"t": {"type": "integer", "minimum": -40, "maximum": -1}}),
    "exclusive_bounds": obj({"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}}),
    "several_fields": obj({"name": NAME, "age": AGE, "score": SCORE, "ok": FLAG}),
    "optional_fields": obj({"name": NAME, "nick": SHORT, "age": AGE}, required=["name"]),
    "all_optional": obj({"a": FLAG, "b": AGE}, required=[]),
    "nested_object": obj({"user": obj({"name": NAME, "age": AGE})}),
    "deep_nesting": obj({"a": obj({"b": obj({"c": obj({"d": FLAG})})})}),
    "array_bounded": obj({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    "array_exact": obj({"xy": {"type": "array", "items": AGE, "minItems": 2, "maxItems": 2}}),
    "array_empty_allowed": obj({"items": {"type": "array", "items": FLAG, "maxItems": 2}}),
    "array_of_objects": obj({"people": {"type": "array", "items": obj({"name": NAME, "age": AGE}),
                                        "minItems": 1, "maxItems": 2}}),
    "array_of_arrays": obj({"grid": {"type": "array", "maxItems": 2,
                                     "items": {"type": "array", "items": AGE, "minItems": 1, "maxItems": 2}}}),
    "top_level_array": {"type": "array", "items": AGE, "minItems": 1, "maxItems": 3},
    "any_of_scalars": obj({"v": {"anyOf": [AGE, FLAG, {"type": "null"}]}}),
    "any_of_objects": obj({"shape": {"anyOf": [obj({"r": AGE}), obj({"w": AGE, "h": AGE})]}}),
    "nullable_type_list": obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "string_pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    "string_exact_length": obj({"pin": {"type": "string", "minLength": 4, "maxLength": 4}}),
    "defs_and_ref": {"$defs": {"item": obj({"id": AGE, "label": SHORT})},
                     **obj({"first": {"$ref": "#/$defs/item"}, "second": {"$ref": "#/$defs/item"}})},
    "enum_in_array": obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                                   "minItems": 1, "maxItems": 3}}),
    "mixed_required_nested": obj({"id": AGE, "meta": obj({"a": SHORT, "b": FLAG}, required=["b"])},
                                 required=["meta"]),
    "fractional_bounds": obj({"n": {"type": "number", "minimum": -1.5, "maximum": 1.5, "multipleOf": 0.5}}),
    "many_fields": obj({f"f{i}": AGE for i in range(8)}),
    "tool_arguments_like": obj({"location": NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
                                "days": {"type": "integer", "minimum": 1, "maximum": 7}}, required=["location"]),
}
