"""Tools in a chat request -> what the prompt shows, what the output is constrained to, how it is read.

    tool_choice   prompt            constraint                         parser (tool_parsers.py)
    none          tools rendered    response_format's, if any          none: the text is content
    auto          tools rendered    none                               the template's format
    required      tools rendered    a JSON array of 1 to max_tool_calls json_array
                                    calls (1 if parallel_tool_calls is
                                    false), each call's arguments its
                                    function's schema
    {function}    tools rendered    that function's arguments schema   arguments

"required" and a named function parse whatever the model is, because the grammar allows
only valid calls. "auto" relies on the model writing its template's call format; the format
is the server's `tool_call_parser` setting, or, when that is "auto", read from the chat
template: a template that mentions `<tool_call>` is Hermes / Qwen; one that mentions
`<|python_tag|>` or `"parameters"` is Llama 3 JSON; any other is read as Hermes. A model
with no template at all gets the tools in a system message (`fallback_system_prompt`) that
asks for the format its tool_choice will read; a template that ignores `tools` shows none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from runtime.json_limits import MAX_SCHEMA_VALUES, count_json_values
from runtime.sampling_params import InvalidRequestError, StructuredOutputs
from service.api.protocol import NAME_PATTERN, ChatCompletionRequest
from service.api.tool_parsers import PARSERS, ArgumentsParser, JsonArrayParser, ToolCallParser

MAX_TOOLS = 128  # tools in one request (OpenAI's limit)

ANY_OBJECT = {"type": "object"}


def template_format(template_source: str | None) -> str:
    """The tool call format a chat template teaches its model ("hermes" or "llama3_json")."""
    source = template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or '"parameters"' in source:
        return "llama3_json"
    return "hermes"


def fallback_system_prompt(plan: ToolPlan) -> str | None:
    """The tools described for a model with no chat template, in the form its tool_choice reads (None: "none")."""
    if plan.choice == "none":
        return None
    if plan.choice == "function":
        [tool] = [t for t in plan.tools if t["function"]["name"] == plan.function_name]
        return f"Answer with the arguments object of this function:\n{json.dumps(tool['function'])}"
    if plan.choice == "required":
        lines = ['Answer with a JSON array of calls, [{"name": <function name>, "arguments": <arguments object>}]:']
    else:
        lines = ["You can call these functions. To call one, write",
                 '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>']
    return "\n".join([*lines, "Functions:", *(json.dumps(tool["function"]) for tool in plan.tools)])


@dataclass
class ToolPlan:
    """One chat request's tools: what to render, what to constrain, how to parse."""

    tools: list[dict]  # OpenAI's tool objects, for the chat template
    choice: str  # "none", "auto", "required" or "function"
    function_name: str | None  # the named function (choice "function")
    parallel: bool
    call_format: str  # for "auto": "hermes" or "llama3_json"
    max_calls: int = 16  # server.max_tool_calls: the bound on a constrained answer's calls

    def constraint(self) -> StructuredOutputs | None:
        """The grammar that makes the output valid calls (required, named), else None."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT for t in self.tools}
        if self.choice == "function":
            return StructuredOutputs(json=schemas[self.function_name], param="tools")
        if self.choice != "required":
            return None
        call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, schema in schemas.items()]
        array = {"type": "array", "items": call[0] if len(call) == 1 else {"anyOf": call}, "minItems": 1,
                 "maxItems": self.max_calls if self.parallel else 1}
        return StructuredOutputs(json=array, param="tools")

    def new_parser(self) -> ToolCallParser | None:
        if self.choice == "function":
            return ArgumentsParser(self.function_name)
        if self.choice == "required":
            return JsonArrayParser()
        if self.choice == "auto":
            return PARSERS[self.call_format]([t["function"]["name"] for t in self.tools])
        return None

    def read_calls(self, parser: ToolCallParser, text: str, last: bool) -> tuple[str | None, list[dict]]:
        """(the part of `text` that is content, None when the answer is only calls; the tool call deltas in it),
        `text` fed to the choice's `parser` (`last`: the choice's final text, so the parser finishes)."""
        content, calls = parser.feed(text)
        if last:
            tail, more = parser.finish()
            content, calls = content + tail, calls + more
        return self.shown_content(content, len(parser.calls)), calls

    def shown_content(self, content: str, num_calls: int) -> str | None:
        """A message's content beside `num_calls` tool calls: OpenAI's null where the answer is only calls (a
        constrained tool choice, or calls with nothing but whitespace beside them), else the text."""
        if self.choice in ("required", "function") or (num_calls and not content.strip()):
            return None
        return content

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's: "tool_calls" when auto or required produced calls; a named call ends "stop"."""
        if reason == "stop" and num_calls and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(body: ChatCompletionRequest, template_source: str | None, configured_format: str,
               max_calls: int = 16, output_constraint: StructuredOutputs | None = None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); raises InvalidRequestError naming the field.

    `configured_format` is server.tool_call_parser (checked by the settings); `output_constraint`
    the body's own (response_format, guided_*), which a constrained tool_choice cannot share.
    """
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise InvalidRequestError("parallel_tool_calls needs tools", param="parallel_tool_calls")
        return None
    if len(body.tools) > MAX_TOOLS:
        raise InvalidRequestError(f"{len(body.tools)} tools; a request takes at most {MAX_TOOLS}", param="tools",
                                  code="too_many_tools")
    tools, names = [], set()
    num_schema_values = 0
    for i, tool in enumerate(body.tools):
        if tool.type != "function" or tool.function is None:
            raise InvalidRequestError(f"tools of type {tool.type!r} are not supported: give function tools",
                                      param=f"tools[{i}].type")
        function = tool.function
        if not NAME_PATTERN.match(function.name):
            raise InvalidRequestError("a function name is 1-64 letters, digits, _ or -", param=f"tools[{i}].function.name")
        if function.name in names:
            raise InvalidRequestError(f"two tools are named {function.name!r}", param=f"tools[{i}].function.name")
        names.add(function.name)
        entry = {"name": function.name}
        if function.description is not None:
            entry["description"] = function.description
        entry["parameters"] = function.parameters if function.parameters is not None else {"type": "object",
                                                                                           "properties": {}}
        num_schema_values += count_json_values(entry["parameters"], MAX_SCHEMA_VALUES)
        if num_schema_values > MAX_SCHEMA_VALUES:  # every tool's schema is compiled into one grammar
            raise InvalidRequestError(f"the tools' parameter schemas have more than {MAX_SCHEMA_VALUES} values in all",
                                      param=f"tools[{i}].function.parameters", code="schema_too_large")
        tools.append({"type": "function", "function": entry})
    function_name = None
    if choice is None:
        choice = "auto"
    elif not isinstance(choice, str):
        if choice.type != "function" or choice.function is None:
            raise InvalidRequestError(f"tool_choice of type {choice.type!r} is not supported", param="tool_choice")
        function_name = choice.function.name
        if function_name not in names:
            raise InvalidRequestError(f"tool_choice names {function_name!r}, which is not among the tools",
                                      param="tool_choice")
        choice = "function"
    if choice in ("required", "function") and output_constraint is not None:
        raise InvalidRequestError("response_format (or a guided_* constraint) cannot apply when the output must be a "
                                  "tool call", param="response_format")
    if choice == "auto" and output_constraint is not None:
        raise InvalidRequestError("tool_choice \"auto\" with response_format is not supported: give tool_choice "
                                  "\"none\" or \"required\"", param="response_format")
    call_format = template_format(template_source) if configured_format == "auto" else configured_format
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolPlan(tools, choice, function_name, parallel, call_format, max_calls)
