"""Every request field of OpenAI's createChatCompletion and createCompletion, and our answer to it.

One of three answers per field (docs/api.md's table is this one; tests/service/test_openai_fields.py
holds them together):
    SUPPORTED  honoured as OpenAI documents it
    IGNORED    accepted and not acted on, because it does not apply to a self-hosted server;
               a response that got one names it in the `pagedserve-ignored-fields` header
               (the WebSocket's "done" message carries the same list) and one log line
    REFUSED    a 400 naming it: honouring it is impossible here, or it is not built yet
Fields outside this table (and vLLM's extras in protocol.py) stay 400 "unknown".
"""

from __future__ import annotations

SUPPORTED, IGNORED, REFUSED = "supported", "accepted, ignored", "400"
IGNORED_HEADER = "pagedserve-ignored-fields"

CHAT_FIELDS: dict[str, tuple[str, str]] = {
    "model": (SUPPORTED, "must name the served model"),
    "messages": (SUPPORTED, "system, developer, user, assistant (with tool_calls), tool; text content parts "
                            "(image, audio and file parts are a 400 naming the part)"),
    "max_tokens": (SUPPORTED, ""),
    "max_completion_tokens": (SUPPORTED, ""),
    "n": (SUPPORTED, "each sample its own grammar state when constrained"),
    "temperature": (SUPPORTED, ""),
    "top_p": (SUPPORTED, ""),
    "stop": (SUPPORTED, "up to 4 strings"),
    "stream": (SUPPORTED, ""),
    "stream_options": (SUPPORTED, "include_usage; continuous_usage_stats (vLLM's: the usage so far on every chunk); "
                                  "include_obfuscation is accepted and ignored (no padding field "
                                  "is added: the stream is not exposed to a third party)"),
    "seed": (SUPPORTED, ""),
    "presence_penalty": (SUPPORTED, ""),
    "frequency_penalty": (SUPPORTED, ""),
    "logit_bias": (SUPPORTED, "token id -> bias in [-100, 100], added before sampling"),
    "logprobs": (SUPPORTED, ""),
    "top_logprobs": (SUPPORTED, "0..20"),
    "response_format": (SUPPORTED, "text, json_object, json_schema (grammar-constrained with llguidance)"),
    "tools": (SUPPORTED, "function tools; custom tools are a 400"),
    "tool_choice": (SUPPORTED, "none, auto (parsed from the chat template's format), required and a named "
                               "function (both grammar-constrained)"),
    "parallel_tool_calls": (SUPPORTED, "false: at most one call"),
    "user": (SUPPORTED, "logged with the request"),
    "safety_identifier": (SUPPORTED, "logged with the request"),
    "prompt_cache_key": (SUPPORTED, "selects an operator's shared prefix; see Prefix caching"),
    "store": (IGNORED, "no completions are stored on a self-hosted server"),
    "metadata": (IGNORED, "only used with store"),
    "service_tier": (IGNORED, "one tier here"),
    "prompt_cache_retention": (IGNORED, "the prefix cache keeps pages until evicted; pin a prefix to keep it"),
    "prediction": (SUPPORTED, "{\"type\": \"content\"} text (or text parts) drafts for speculative decoding: "
                              "verified by the model, so the output is the same as without it; usage reports "
                              "accepted and rejected prediction tokens"),
    "reasoning_effort": (IGNORED, "the served model has no reasoning mode"),
    "verbosity": (IGNORED, "the served model has no verbosity control"),
    "modalities": (SUPPORTED, "[\"text\"]; any other modality is a 400"),
    "audio": (REFUSED, "the model has no audio output"),
    "web_search_options": (REFUSED, "the server has no web search"),
    "functions": (REFUSED, "deprecated by OpenAI: use tools"),
    "function_call": (REFUSED, "deprecated by OpenAI: use tool_choice"),
}

COMPLETION_FIELDS: dict[str, tuple[str, str]] = {
    "model": (SUPPORTED, "must name the served model"),
    "prompt": (SUPPORTED, "a string, strings, token ids or lists of token ids"),
    "max_tokens": (SUPPORTED, "default 16"),
    "n": (SUPPORTED, ""),
    "temperature": (SUPPORTED, ""),
    "top_p": (SUPPORTED, ""),
    "stop": (SUPPORTED, "up to 4 strings"),
    "stream": (SUPPORTED, ""),
    "stream_options": (SUPPORTED, "include_usage; continuous_usage_stats (vLLM's: the usage so far on every chunk); "
                                  "include_obfuscation is accepted and ignored"),
    "seed": (SUPPORTED, ""),
    "presence_penalty": (SUPPORTED, ""),
    "frequency_penalty": (SUPPORTED, ""),
    "logit_bias": (SUPPORTED, "token id -> bias in [-100, 100]"),
    "logprobs": (SUPPORTED, "0..20"),
    "echo": (SUPPORTED, "the prompt text before the completion; with logprobs it is a 400 (prompt logprobs "
                        "are not computed)"),
    "user": (SUPPORTED, "logged with the request"),
    "best_of": (SUPPORTED, "best_of samples are drawn (and billed) and the n with the highest logprob per token "
                           "returned; not with stream, as OpenAI"),
    "suffix": (REFUSED, "the served models have no fill-in-the-middle tokens"),
}

MESSAGE_FIELDS: dict[str, tuple[str, str]] = {
    "role": (SUPPORTED, "system, developer, user, assistant, tool (function: 400, deprecated)"),
    "content": (SUPPORTED, "a string or text parts (an assistant's refusal parts read as text)"),
    "name": (SUPPORTED, "passed to the chat template"),
    "tool_calls": (SUPPORTED, "an assistant's earlier calls, passed to the chat template"),
    "tool_call_id": (SUPPORTED, "a tool result's call, passed to the chat template"),
    "refusal": (SUPPORTED, "an assistant's earlier refusal, passed to the chat template"),
    "audio": (REFUSED, "no audio"),
    "function_call": (REFUSED, "deprecated by OpenAI: use tool_calls"),
}


VLLM_IGNORED = ("guided_decoding_backend",)  # vLLM's extras that choose nothing here (one grammar engine)


def ignored_fields(body, table: dict[str, tuple[str, str]]) -> list[str]:
    """The IGNORED fields `body` set (not null), in table order, then vLLM's ignored extras."""
    ignored = [name for name, (answer, _) in table.items()
               if answer == IGNORED and getattr(body, name, None) is not None]
    ignored += [name for name in VLLM_IGNORED if getattr(body, name, None) is not None]
    options = getattr(body, "stream_options", None)
    if options is not None and options.include_obfuscation is not None:
        ignored.append("stream_options.include_obfuscation")
    return ignored
