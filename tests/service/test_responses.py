"""OpenAI's Responses API through OpenAI's official client: one generation core with chat completions.

The model is the random Qwen2 with a Hermes template (tests/service/hermes.py): its text is noise,
so the checks compare each response with the chat completion of the same conversation (greedy:
token for token), and tools and formats are what the grammar forces. Every response and event
is also validated against the SDK's models (generated from OpenAI's published spec).
"""

from __future__ import annotations

import json
import time
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent

from tests.service.conftest import run_server, stories_settings, write_tenants_file
from tests.service.hermes import TOOL_SCHEMAS, WEATHER, make_hermes_checkpoint

KEY, OTHER_KEY = "sk-acme-responses", "sk-globex-responses"
MODEL = "qwen2-hermes"
SYSTEM = ("You are the assistant of a small bakery. You answer questions about bread, cakes and opening hours. "
          "The bakery opens at seven and closes at six, every day but Sunday. ") * 3
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(random_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    model = make_hermes_checkpoint(random_checkpoints["qwen2"], root / MODEL)
    tenants = write_tenants_file(root / "tenants.toml", {"acme": {"keys": [KEY], "plan": "standard"},
                                                         "globex": {"keys": [OTHER_KEY], "plan": "standard"}})
    settings = stories_settings(model, {"tenants_file": str(tenants), "open_metrics": True}, num_blocks=1024,
                                max_num_seqs=16)
    with run_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def other(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=OTHER_KEY, max_retries=0)


def _chat(client, messages: list[dict], max_tokens: int, **extra) -> dict:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          **extra).model_dump()


def _raw(server, body: dict, key: str = KEY) -> requests.Response:
    return requests.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60,
                         headers={"Authorization": f"Bearer {key}"})


def test_a_response_is_the_chat_completion_of_the_same_conversation(server, client):
    chat = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}], 12)
    raw = _raw(server, {"instructions": SYSTEM, "input": "When do you open?", "max_output_tokens": 12,
                        "temperature": 0})
    assert raw.status_code == 200
    response = Response.model_validate(raw.json())  # every field OpenAI's spec requires, of its type
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat["choices"][0]["message"]["content"]
    # the text ran to max_output_tokens: incomplete, as OpenAI reports it
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    usage = response.usage
    assert usage.output_tokens == 12 and usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens > 0  # the same prompt as the chat completion's: its pages


def test_streamed_events_come_in_order_and_add_up_to_the_response(client):
    kwargs = dict(model=MODEL, instructions=SYSTEM, input="Which cakes do you bake?", max_output_tokens=16,
                  temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    for event in events:
        EVENTS.validate_python(event.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                                     "response.output_text.done", "response.content_part.done",
                                     "response.output_item.done", "response.incomplete"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-3].part.text == events[-1].response.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    final = events[-1].response
    assert final.usage.output_tokens == 16 and final.usage.input_tokens == whole.usage.input_tokens


def test_a_pydantic_format_is_parsed(client):
    class Hours(pydantic.BaseModel):  # bounded, so the random model's JSON ends
        day: Literal["Monday", "Sunday"]
        opens: int = pydantic.Field(ge=0, le=23)
        closes: int = pydantic.Field(ge=0, le=23)

    parsed = client.responses.parse(model=MODEL, input="When are you open on Monday?", text_format=Hours,
                                    max_output_tokens=200, temperature=0)
    assert isinstance(parsed.output_parsed, Hours)
    assert parsed.status == "completed"


def test_a_forced_tool_call_is_a_function_call_item_and_its_output_continues_the_turn(server, client):
    tool = {"type": "function", "name": "get_weather", "description": WEATHER["function"]["description"],
            "parameters": WEATHER["function"]["parameters"], "strict": True}
    first = client.responses.create(model=MODEL, input="What is the weather in Oslo?", tools=[tool],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                    temperature=0)
    Response.model_validate(first.model_dump())
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), TOOL_SCHEMAS["get_weather"])
    # the tool's result goes back as a function_call_output item, continuing the stored turn
    second = client.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=8, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Sunny, 21 degrees"}])
    chat = _chat(client, [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 degrees"}], 8)  # tools: not carried over
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id


def test_streamed_tool_calls_send_argument_events(client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"],
            "strict": True}
    events = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False,
                                          max_output_tokens=200, temperature=0, stream=True))
    for event in events:
        EVENTS.validate_python(event.model_dump())
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == done[0].arguments == events[-1].response.output[0].arguments
    jsonschema.validate(json.loads(deltas), TOOL_SCHEMAS["get_weather"])


def test_previous_response_id_continues_the_conversation_from_the_cache(client):
    story = "Tell me about your breads. " * 20
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input=story, max_output_tokens=24, temperature=0)
    second = client.responses.create(model=MODEL, instructions=SYSTEM, previous_response_id=first.id,
                                     input="And the cakes?", max_output_tokens=10, temperature=0)
    chat = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": story},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And the cakes?"}], 10)
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    # the second turn's prompt starts with the first turn's prompt: every full page of it is a hit
    page = 16
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // page * page


def test_a_stored_response_is_retrieved_listed_and_deleted(client):
    created = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, metadata={"ticket": "42"},
                                      input=[{"role": "developer", "content": "Be brief."},
                                             {"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}])
    fetched = client.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump() and fetched.metadata == {"ticket": "42"}
    items = client.responses.input_items.list(created.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [("developer", "Be brief."), ("user", "Hello")]
    newest = client.responses.input_items.list(created.id, limit=1)
    assert [i.role for i in newest.data] == ["user"] and newest.has_more
    client.responses.delete(created.id)  # the SDK returns nothing; the wire answer is checked on the next delete
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)  # gone: a second delete finds nothing
    kept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    answer = requests.delete(f"{client.base_url}responses/{kept.id}", headers={"Authorization": f"Bearer {KEY}"},
                             timeout=10)
    assert answer.status_code == 200 and answer.json() == {"id": kept.id, "object": "response.deleted",
                                                           "deleted": True}
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=unstored.id)


def test_a_background_response_runs_after_the_reply_and_can_be_cancelled(client):
    queued = client.responses.create(model=MODEL, input="Write a long story.", max_output_tokens=1500,
                                     temperature=0, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 1500
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"  # cancelling again says the same
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, background=True)
    deadline = time.monotonic() + 30
    while (state := client.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert state.status == "incomplete" and state.usage.output_tokens == 3
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)  # it is not running


def test_one_tenant_cannot_reach_another_tenants_response(client, other):
    mine = client.responses.create(model=MODEL, input="A secret plan", max_output_tokens=2)
    for attempt in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                    lambda: other.responses.cancel(mine.id), lambda: other.responses.input_items.list(mine.id),
                    lambda: other.responses.create(model=MODEL, input="go on", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert mine.id in caught.value.message or "not found" in caught.value.message
    assert client.responses.retrieve(mine.id).id == mine.id  # untouched


def test_a_stream_cut_by_the_client_is_billed(server):
    before = requests.get(server.url + "/v1/usage", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    with requests.post(server.url + "/v1/responses", stream=True, timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "input": "Tell me everything.", "max_output_tokens": 1500,
                             "stream": True}) as response:
        lines = response.iter_lines()
        while b"response.output_text.delta" not in next(lines):
            pass
    deadline = time.monotonic() + 20
    while True:
        after = requests.get(server.url + "/v1/usage", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        if after["requests"] > before["requests"]:
            break
        assert time.monotonic() < deadline, "the cut stream was never billed"
        time.sleep(0.1)
    assert 0 < after["completion_tokens"] - before["completion_tokens"] < 1500


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True, "stream": True}, "background"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "word " * 5000}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    response = _raw(server, body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] in ("invalid_request_error", "not_found_error")


def test_ignored_fields_are_named(server):
    response = _raw(server, {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"},
                             "service_tier": "flex"})
    assert response.status_code == 200
    assert response.headers["pagedserve-ignored-fields"] == "reasoning, service_tier"


def _lane_events(connection, want_done: set[str]) -> dict[str, list]:
    """Events by stream_id until every lane in `want_done` has its final event."""
    lanes: dict[str, list] = {}
    done: set[str] = set()
    while not want_done <= done:
        event = connection.recv()
        assert event.type != "error", event
        lanes.setdefault(event.stream_id, []).append(event)
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            done.add(event.stream_id)
    return lanes


def test_the_websocket_runs_responses_at_once_on_lanes_and_cancels_by_id(client):
    create = {"type": "response.create", "model": MODEL, "temperature": 0}
    short = client.responses.create(model=MODEL, input="Hi there", max_output_tokens=6, temperature=0, store=False)
    with client.responses.connect() as connection:
        connection.send({**create, "input": "Tell me a very long story.", "max_output_tokens": 1500, "stream_id": "long"})
        first = connection.recv()
        assert first.type == "response.created" and first.stream_id == "long"
        long_id = first.response.id
        connection.send({**create, "input": "Hi there", "max_output_tokens": 6, "stream_id": "short"})
        lanes = _lane_events(connection, {"short"})  # the short one ends while the long one still runs
        assert lanes["short"][-1].response.output_text == short.output_text
        assert [e.sequence_number for e in lanes["short"]] == list(range(len(lanes["short"])))
        assert lanes["short"][-1].response.id != long_id
        connection.send_raw(json.dumps({"type": "response.cancel", "response_id": long_id}))
        lanes = _lane_events(connection, {"long"})
        final = lanes["long"][-1]
        assert final.type == "response.incomplete" and final.response.status == "cancelled"
        assert 0 < final.response.usage.output_tokens < 1500
        assert client.responses.retrieve(long_id).status == "cancelled"
        # one lane runs its creates in order: the second starts once the first has ended
        connection.send({**create, "input": "One", "max_output_tokens": 3, "stream_id": "fifo"})
        connection.send({**create, "input": "Two", "max_output_tokens": 3, "stream_id": "fifo"})
        kinds = []
        while kinds.count("response.incomplete") + kinds.count("response.completed") < 2:
            kinds.append(connection.recv().type)
        assert kinds.index("response.created", 1) > kinds.index("response.incomplete")
        connection.send_raw(json.dumps({"type": "response.create", "model": MODEL, "input": "x", "stream": True}))
        error = connection.recv()
        assert error.type == "error" and error.error.param == "stream" and error.status == 400


def test_tokenize_and_detokenize_need_a_key_and_count_the_chat_prompt(server, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]
    for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
        assert requests.post(server.url + path, json=body, timeout=10).status_code == 401  # vLLM's are open
    auth = {"Authorization": f"Bearer {KEY}"}
    counted = requests.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}, headers=auth,
                            timeout=10).json()
    assert counted["count"] == len(counted["tokens"]) == _chat(client, messages, 1)["usage"]["prompt_tokens"]
    text = requests.post(server.url + "/tokenize", json={"prompt": "Bread and cakes", "return_token_strs": True},
                         headers=auth, timeout=10).json()
    assert "".join(text["token_strs"]).replace("\u2581", " ").endswith("Bread and cakes")  # sentencepiece pieces
    back = requests.post(server.url + "/detokenize", json={"tokens": text["tokens"]}, headers=auth, timeout=10).json()
    assert back["prompt"] == "Bread and cakes"
    bad = requests.post(server.url + "/detokenize", json={"tokens": [5, 10 ** 9]}, headers=auth, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"


def test_chat_template_kwargs_reach_the_template(server, client):
    """vLLM's chat_template_kwargs: enable_thinking false writes Qwen3's empty think block (this template does too)."""
    messages = [{"role": "user", "content": "When do you open?"}]
    auth = {"Authorization": f"Bearer {KEY}"}

    def tokens(**body):
        return requests.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages, **body},
                             headers=auth, timeout=10).json()["tokens"]

    thinking, plain = tokens(), tokens(chat_template_kwargs={"enable_thinking": False})
    assert plain[: len(thinking)] == thinking and len(plain) > len(thinking)
    chat = _chat(client, messages, 1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat["usage"]["prompt_tokens"] == len(plain)
    bad = requests.post(server.url + "/v1/chat/completions", headers=auth, timeout=10, json={
        "model": MODEL, "messages": messages, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    content = [c for c in chunks if c.choices]
    assert content and all(c.usage is not None for c in content)
    produced = [c.usage.completion_tokens for c in content]
    assert produced == sorted(produced) and produced[-1] == 8 == chunks[-1].usage.completion_tokens
    assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_metrics_and_the_dashboard_count_requests_by_api(server, client):
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    requests.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=30, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}).raise_for_status()
    _chat(client, [{"role": "user", "content": "Hi"}], 1)
    text = requests.get(server.url + "/metrics", timeout=10).text  # open_metrics: no key, no tenant's series
    assert "pagedserve_tenant_" not in text and "pagedserve_kv_blocks_in_use" in text
    counts = {line.split('api="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("pagedserve_api_requests_total{")}
    assert counts["responses"] >= 1 and counts["messages"] >= 1 and counts["chat.completions"] >= 1
    assert server.state.metrics.requests_by_api["responses"] == counts["responses"]


def test_cached_and_written_tokens_are_exact_pages(server, client):
    salt, page = f"exact-{time.time_ns()}", 16

    def ask(question: str):
        return client.responses.create(model=MODEL, instructions=SYSTEM, input=question, max_output_tokens=2,
                                       temperature=0, store=False, extra_body={"cache_salt": salt}).usage

    prompts = [server.state.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                            {"role": "user", "content": q}]) for q in ("Rye?", "Spelt?")]
    first, second = ask("Rye?"), ask("Spelt?")
    assert first.input_tokens == len(prompts[0]) and second.input_tokens == len(prompts[1])
    # a salt nothing used before: turn one reads nothing and writes every full page of its prompt
    assert first.input_tokens_details.cached_tokens == 0
    assert first.input_tokens_details.cache_write_tokens == len(prompts[0]) // page * page
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert second.input_tokens_details.cached_tokens == shared // page * page >= 10 * page
    assert second.input_tokens_details.cache_write_tokens == len(prompts[1]) // page * page - shared // page * page
