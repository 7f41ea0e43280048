"""Chat messages -> prompt text, through the checkpoint's Jinja template or a plain fallback.

The fallback (for models that ship no template, like stories260K) writes each message as a
`role: content` line (an assistant's tool calls after it, in Hermes' `<tool_call>` form) and
ends with `assistant:`.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runtime.sampling_params import InvalidRequestError


def fallback_chat_prompt(messages: list[dict]) -> str:
    lines = [f"{m['role']}: {m.get('content') or ''}{_calls_text(m)}" for m in messages]
    return "\n".join(lines + ["assistant:"])


def _calls_text(message: dict) -> str:
    """An assistant's earlier tool calls, in Hermes' format (what the fallback asks tools to be called in)."""
    calls = message.get("tool_calls") or []
    return "".join(
        "<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "</tool_call>" for c in calls)


def _raise(message: str):
    raise InvalidRequestError(f"chat template: {message}", param="messages")


class ChatTemplate:
    """A compiled Jinja chat template (sandboxed), or the fallback when `source` is None."""

    def __init__(self, source: str | None, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(source)

    @property
    def is_fallback(self) -> bool:
        return self._template is None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               template_kwargs: dict | None = None) -> str:
        """The prompt text for `messages` (each a dict with role and content); `tools` (OpenAI's tool
        objects) go to the template as `tools`, as Hugging Face templates expect them; `template_kwargs`
        are more variables (Qwen3's enable_thinking), which cannot replace the ones set here."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise InvalidRequestError(f"messages[{i}] must be an object with a role", param="messages")
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # set below, on every path
        taken = sorted(set(template_kwargs or {}) & reserved)
        if taken:
            raise InvalidRequestError(f"chat_template_kwargs cannot set {', '.join(taken)}",
                                      param="chat_template_kwargs")
        if self._template is None:
            return fallback_chat_prompt(messages)
        variables = dict(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                         bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return self._template.render(**(template_kwargs or {}), **variables)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
