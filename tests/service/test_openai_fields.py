"""Every official OpenAI request field has one answer, docs/api.md says the same, and each answer holds.

OFFICIAL lists the request fields of OpenAI's createChatCompletion and createCompletion (and
the chat message fields) as the OpenAI API reference gives them.
"""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
import requests

from openai.types.responses.response_create_params import ResponseCreateParamsBase

from service.api.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, IGNORED, IGNORED_HEADER, MESSAGE_FIELDS,
                                       REFUSED, SUPPORTED)
from service.api.responses_protocol import RESPONSES_FIELDS

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
OFFICIAL = {
    "chat": ["messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
             "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
             "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort",
             "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
             "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
             "web_search_options"],
    "completions": ["model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
                    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                    "top_p", "user"],
    "message": ["role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call"],
    # createResponse as the official SDK (generated from OpenAI's spec) types it, plus `stream`
    "responses": [*ResponseCreateParamsBase.__annotations__, "stream"],
}
TABLES = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS, "message": MESSAGE_FIELDS,
          "responses": RESPONSES_FIELDS}
MODEL = "stories260K"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "Once upon", "max_tokens": 3}

# a value for each IGNORED and REFUSED field, as a client would send it
SAMPLES = {
    "store": True, "metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "Hello"}, "reasoning_effort": "low", "verbosity": "low",
    "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {}, "functions": [{"name": "f"}],
    "function_call": "auto", "suffix": "The end.",
}


@pytest.mark.parametrize("kind", list(OFFICIAL))
def test_every_official_field_has_exactly_one_answer(kind):
    assert sorted(TABLES[kind]) == sorted(OFFICIAL[kind])
    assert all(answer in (SUPPORTED, IGNORED, REFUSED) for answer, _ in TABLES[kind].values())


def test_the_api_doc_tables_are_the_code_tables():
    text = API_DOC.read_text()
    for kind, title in (("chat", "chat field"), ("message", "message field"), ("completions", "completions field"),
                        ("responses", "responses field")):
        block = text[text.index(f"| {title} | answer | notes |"):]
        block = block[: block.index("\n\n")]
        rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \| ([^|]*) \|$", block, re.M)
        assert {name: (answer.strip(), why.strip()) for name, answer, why in rows} == TABLES[kind], kind
        assert len(rows) == len(TABLES[kind]), kind


@pytest.mark.parametrize("path, body, table", [("/v1/chat/completions", CHAT, CHAT_FIELDS),
                                               ("/v1/completions", COMPLETION, COMPLETION_FIELDS)])
def test_ignored_fields_are_named_and_refused_ones_are_a_400_naming_them(server, path, body, table):
    for name, (answer, _) in table.items():
        if answer == IGNORED:
            response = requests.post(server.url + path, json={**body, name: SAMPLES[name]}, timeout=30)
            assert response.status_code == 200, (name, response.text)
            assert response.headers[IGNORED_HEADER] == name
        elif answer == REFUSED:
            response = requests.post(server.url + path, json={**body, name: SAMPLES[name]}, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"] == name, (name, response.text)
    plain = requests.post(server.url + path, json=body, timeout=30)
    assert plain.status_code == 200 and IGNORED_HEADER not in plain.headers
    extra = {"store": False} if "store" in table else {}  # false is still a value the server did not act on
    options = requests.post(server.url + path, json={**body, **extra, "stream": True,
                                                     "stream_options": {"include_obfuscation": False}}, timeout=30)
    assert options.headers[IGNORED_HEADER] == ", ".join([*extra, "stream_options.include_obfuscation"])
    backend = requests.post(server.url + path, json={**body, "guided_decoding_backend": "xgrammar"}, timeout=30)
    assert backend.status_code == 200 and backend.headers[IGNORED_HEADER] == "guided_decoding_backend"
    assert options.text.rstrip().endswith("data: [DONE]")


RESPONSES_SAMPLES = {
    "reasoning": {"effort": "low"}, "service_tier": "auto", "prompt_cache_retention": "24h", "prompt_cache_options": {},
    "max_tool_calls": 3, "background_options": {}, "top_logprobs": 2, "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"}, "context_management": [{"type": "compaction"}], "moderation": {}, "image": {},
    "access_programs": [],
}


def test_responses_ignored_fields_are_named_and_refused_ones_are_a_400_naming_them(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False}
    for name, (answer, _) in RESPONSES_FIELDS.items():
        if answer == SUPPORTED:
            continue
        response = requests.post(server.url + "/v1/responses", json={**body, name: RESPONSES_SAMPLES[name]}, timeout=30)
        if answer == IGNORED:
            assert response.status_code == 200 and response.headers[IGNORED_HEADER] == name, (name, response.text)
        else:
            assert response.status_code == 400 and response.json()["error"]["param"] == name, (name, response.text)
    assert IGNORED_HEADER not in requests.post(server.url + "/v1/responses", json=body, timeout=30).headers


def test_message_fields(server):
    url = server.url + "/v1/chat/completions"
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}], "refusal": "No.",
                     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    assert requests.post(url, json={**CHAT, "messages": conversation}, timeout=30).status_code == 200
    for change, param in [({"audio": {"id": "a1"}}, "messages[0].audio"),
                          ({"function_call": {"name": "f", "arguments": "{}"}}, "messages[0].function_call"),
                          ({"role": "function", "name": "f"}, "messages[0].role")]:
        message = {"role": "assistant", "content": "x", **change}
        response = requests.post(url, json={**CHAT, "messages": [message]}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_supported_completion_fields_echo_best_of_and_logit_bias(server, golden):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    case = golden["cases"][0]
    echoed = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=10, temperature=0, echo=True)
    assert case["text"].startswith(echoed.choices[0].text) and echoed.choices[0].text.startswith(case["prompt"])
    streamed = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=10, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    several = client.completions.create(model=MODEL, prompt=["Once upon", "The dog"], max_tokens=3, n=2,
                                        temperature=1.0, seed=1, echo=True)
    assert [c.text.split(" ")[0] for c in several.choices] == ["Once", "Once", "The", "The"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", echo=True, logprobs=1)

    kwargs = dict(model=MODEL, prompt=case["prompt"], max_tokens=8, temperature=1.0, seed=7)
    drawn = client.completions.create(**kwargs, n=4, logprobs=0)
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in drawn.choices]
    best = client.completions.create(**kwargs, n=2, best_of=4)
    ranked = sorted(range(4), key=lambda i: -mean[i])[:2]
    assert [c.text for c in best.choices] == [drawn.choices[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == drawn.usage.completion_tokens  # all four samples are billed
    for bad in (dict(n=3, best_of=2), dict(n=1, best_of=2, stream=True)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**kwargs, **bad)
        assert caught.value.body["param"] == "best_of"

    plain = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=4, temperature=0)
    first = plain.choices[0]
    forced = client.completions.create(model=MODEL, prompt=case["prompt"], max_tokens=4, temperature=0,
                                       logit_bias={"400": 100})
    assert forced.choices[0].text != first.text
    piece = server.state.tokenizer.decode([400]).strip()
    assert forced.choices[0].text.split() == [piece] * 4  # +100 wins every greedy step
