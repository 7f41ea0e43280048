"""Anthropic's Messages API through Anthropic's official client: one generation core with chat completions.

The model is the random Qwen2 with a Hermes template (tests/service/hermes.py): its text is noise,
so the checks compare the Messages answer with the chat completion of the same conversation
(greedy: token for token), and tools are what the grammar forces.
"""

from __future__ import annotations

from decimal import Decimal

import anthropic
import jsonschema
import openai
import pytest
import requests

from tests.service.conftest import run_server, stories_settings, write_tenants_file
from tests.service.hermes import SEARCH, TOOL_SCHEMAS, WEATHER, make_hermes_checkpoint

KEY = "sk-ant-acme-test"
MODEL = "qwen2-hermes"
SYSTEM = ("You are the assistant of a small bakery. You answer questions about bread, cakes and opening hours. "
          "The bakery opens at seven and closes at six, every day but Sunday. ") * 3
GREEDY = {"temperature": 0}  # Anthropic's current client has no sampling fields: they go as extra fields
TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, SEARCH)]


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    model = make_hermes_checkpoint(random_checkpoints["qwen2"], root / MODEL)
    tenants = write_tenants_file(root / "tenants.toml", {"acme": {"keys": [KEY], "plan": "standard"}},
                                 plans={"standard": {"input_per_mtok": 0.5, "cached_input_per_mtok": 0.05,
                                                     "output_per_mtok": 1.5}})
    settings = stories_settings(model, {"tenants_file": str(tenants)}, num_blocks=1024, max_num_seqs=16)
    with run_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _chat_answer(server, messages: list[dict], max_tokens: int, **extra) -> dict:
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    return chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                        **extra).model_dump()


def test_a_message_is_the_chat_completion_of_the_same_conversation(server, client):
    chat = _chat_answer(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}],
                        12)
    message = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "When do you open?"}])
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage, chat_usage = message.usage, chat["usage"]
    assert usage.output_tokens == 12
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == \
        chat_usage["prompt_tokens"]
    # the same conversation again: its pages are read from the cache, and input_tokens counts only the rest
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM,
                                           messages=[{"role": "user", "content": "When do you open?"}])
    assert counted.input_tokens == chat_usage["prompt_tokens"]


def test_system_blocks_and_a_stop_sequence(server, client):
    question = [{"role": "user", "content": [{"type": "text", "text": "Which cakes "},
                                              {"type": "text", "text": "do you bake?"}]}]
    plain = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, messages=question,
                                   system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}])
    text = plain.content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    stopped = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, messages=question, system=SYSTEM,
                                     stop_sequences=[stop, "never-there"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_streamed_events_spell_the_same_message(client):
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, system=SYSTEM,
                  messages=[{"role": "user", "content": "Tell me about bread."}])
    whole = client.messages.create(**kwargs)
    kinds = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_validates_and_its_result_goes_back(client, stream):
    kwargs = dict(model=MODEL, max_tokens=300, extra_body={"temperature": 1.0}, tools=TOOLS,
                  tool_choice={"type": "tool", "name": "search"},
                  messages=[{"role": "user", "content": "Find a bakery."}])
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert [call.name for call in calls] == ["search"]
    jsonschema.validate(calls[0].input, TOOL_SCHEMAS["search"])
    answer = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, tools=TOOLS, messages=[
        *kwargs["messages"], {"role": "assistant", "content": [
            {"type": "tool_use", "id": c.id, "name": c.name, "input": c.input} for c in calls]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Open at 7."}]}])
    assert answer.content and answer.usage.output_tokens > 0


def test_any_tool_choice_calls_one_of_the_tools(client):
    message = client.messages.create(model=MODEL, max_tokens=300, extra_body={"temperature": 1.0}, tools=TOOLS,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                     messages=[{"role": "user", "content": "Weather?"}])
    calls = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(calls) == 1
    jsonschema.validate(calls[0].input, TOOL_SCHEMAS[calls[0].name])


def test_errors_come_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    cases = [
        ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),  # required, as Anthropic's
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "colour": "red"}, "colour"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}, "nope"),
    ]
    for body, named in cases:
        response = requests.post(server.url + "/v1/messages", json=body, timeout=10,
                                 headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
        assert response.status_code in (400, 404), response.text
        error = response.json()
        assert error["type"] == "error" and named in error["error"]["message"], error
        assert error["error"]["type"] == ("not_found_error" if response.status_code == 404 else "invalid_request_error")


def test_usage_is_billed_with_the_cached_part_at_its_own_price(server, client):
    def totals():
        return requests.get(server.url + "/v1/usage", headers={"x-api-key": KEY, "Authorization": f"Bearer {KEY}"},
                            timeout=10).json()

    def ask():  # a cache scope of this test's own: what earlier tests cached does not count
        return client.messages.create(model=MODEL, max_tokens=4, extra_body={**GREEDY, "cache_salt": "own-price"},
                                      system=SYSTEM, messages=[{"role": "user", "content": "And on Sunday?"}])

    ask()  # writes the system prompt's pages
    server.wait_idle()
    before = totals()
    usage = ask().usage
    server.wait_idle()
    after = totals()
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert after["requests"] - before["requests"] == 1
    assert after["cached_tokens"] - before["cached_tokens"] == usage.cache_read_input_tokens > 0
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt
    # the plan's prices per million: 0.50 fresh input, 0.05 cached input, 1.50 output
    cached = usage.cache_read_input_tokens
    price = (Decimal("0.50") * (prompt - cached) + Decimal("0.05") * cached
             + Decimal("1.50") * usage.output_tokens) / 1_000_000
    assert Decimal(after["cost_usd"]) - Decimal(before["cost_usd"]) == price


@pytest.mark.parametrize("stream", [False, True])
def test_a_cache_control_prefix_is_written_once_then_read_and_a_cache_salt_splits_it(server, client, stream):
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    salt = f"recipes-{stream}"  # a cache scope of its own: nothing before this test wrote to it
    page = 16

    def ask(question: str, cache_salt: str = salt):
        kwargs = dict(model=MODEL, max_tokens=3, system=system, messages=[{"role": "user", "content": question}],
                      extra_body={**GREEDY, "cache_salt": cache_salt})
        if not stream:
            return client.messages.create(**kwargs).usage
        with client.messages.stream(**kwargs) as events:
            return events.get_final_message().usage

    def prompt_tokens(question: str) -> int:
        return client.messages.count_tokens(model=MODEL, system=system,
                                            messages=[{"role": "user", "content": question}]).input_tokens

    first = ask("Rye?")
    # nothing was cached: every full page of the prompt is written, the partial last page is plain input
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens == prompt_tokens("Rye?") // page * page
    assert first.input_tokens == prompt_tokens("Rye?") - first.cache_creation_input_tokens
    second = ask("Spelt?")
    # the prefix the two prompts share (the marked system prompt, up to the question) is read back, every full
    # page of it, and nothing is written twice
    prompts = [server.state.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": q}]) for q in ("Rye?", "Spelt?")]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert second.cache_read_input_tokens == shared // page * page >= 10 * page
    assert second.input_tokens + second.cache_read_input_tokens + second.cache_creation_input_tokens == \
        prompt_tokens("Spelt?")
    other = ask("Spelt?", cache_salt=f"{salt}-other")  # the same tenant, another salt: a cache of its own
    assert other.cache_read_input_tokens == 0 and other.cache_creation_input_tokens > 0


def test_output_config_format_constrains_the_answer_and_prefill_is_refused(server, client):
    schema = {"type": "object", "properties": {"opens": {"type": "integer", "minimum": 0, "maximum": 23}},
              "required": ["opens"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=60, extra_body={"temperature": 1.0},
                                     output_config={"format": {"type": "json_schema", "schema": schema}},
                                     messages=[{"role": "user", "content": "When do you open?"}])
    import json

    jsonschema.validate(json.loads(message.content[0].text), schema)
    response = requests.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=10, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Hello, I"}]})
    assert response.status_code == 400 and "prefill" in response.json()["error"]["message"]


def test_raw_events_and_messages_validate_against_the_sdks_spec_types(server):
    import json as _json
    import time

    import pydantic
    from anthropic.types import Message, RawMessageStreamEvent

    events = pydantic.TypeAdapter(RawMessageStreamEvent)
    body = {"model": MODEL, "max_tokens": 12, "system": SYSTEM, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about bread."}]}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    whole = requests.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).json()
    Message.model_validate(whole)  # every field Anthropic's spec requires, of its type
    kinds = []
    with requests.post(server.url + "/v1/messages", json={**body, "stream": True}, headers=headers, stream=True,
                       timeout=60) as response:
        name = None
        for line in response.iter_lines():
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = _json.loads(line[6:])
                assert data["type"] == name  # the SSE event name is the payload's type
                if name == "ping":  # not a message event in the SDK's union: its shape is just this
                    assert data == {"type": "ping"}
                else:
                    events.validate_python(data)
                kinds.append(name)
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1 and kinds == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    # a stream the client cuts is billed: the ledger gets one more request, with the tokens it was sent
    usage_headers = {"Authorization": f"Bearer {KEY}"}
    before = requests.get(server.url + "/v1/usage", headers=usage_headers, timeout=10).json()
    with requests.post(server.url + "/v1/messages", json={**body, "max_tokens": 1500, "stream": True}, headers=headers,
                       stream=True, timeout=60) as response:
        lines = response.iter_lines()
        while b"content_block_delta" not in next(lines):
            pass
    deadline = time.monotonic() + 20
    while (after := requests.get(server.url + "/v1/usage", headers=usage_headers, timeout=10).json())["requests"] == \
            before["requests"]:
        assert time.monotonic() < deadline, "the cut stream was never billed"
        time.sleep(0.1)
    assert 0 < after["completion_tokens"] - before["completion_tokens"] < 1500
