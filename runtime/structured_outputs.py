"""What a caller constrains the output to: a JSON schema, any JSON object, a regex, a choice, a grammar.

Plain data (it crosses to workers inside SamplingParams); runtime/grammar.py compiles it.
Exactly one constraint is set. `param` is the request field it came from, so a constraint
the grammar engine refuses is a 400 that names the field the caller wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime.errors import InvalidRequestError
from runtime.json_limits import check_schema_size, decode_json

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """One output constraint (vLLM's StructuredOutputsParams, by its field names)."""

    json: dict | str | None = None  # a JSON schema (an object, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's), or GBNF (llama.cpp's, with ::=)
    param: str = "structured_outputs"  # the request field, for errors

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"give exactly one output constraint ({', '.join(KINDS)}); got {', '.join(given) or 'none'}",
                param=self.param)
        if isinstance(self.json, str):
            try:
                self.json = decode_json(self.json, self.param)
            except msgspec.DecodeError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=self.param) from exc
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object", param=self.param)
        if isinstance(self.json, dict):
            check_schema_size(self.json, self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=self.param)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{kind} must be a non-empty string", param=self.param)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def cache_key(self) -> str:
        """The constraint itself, canonically (same schema, same key; `param` is not part of it)."""
        return json.dumps([self.kind, self.value], sort_keys=True, separators=(",", ":"))
