"""Structured outputs and tools through the server: the official openai client, SSE, the WebSocket.

The model is a random-weight Qwen2 (noise) with stories260K's tokenizer and a Hermes-style
chat template written here, so only the grammar makes its outputs parse.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pydantic
import pytest
import requests
import websockets.sync.client

from service.api.protocol import ChatCompletionRequest, decode_body
from tests.service.conftest import run_server, stories_settings
from tests.service.hermes import SEARCH, TOOL_SCHEMAS, WEATHER, make_hermes_checkpoint
from tests.structured.schema_battery import SCHEMAS

MESSAGES = [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def model_dir(random_checkpoints, tmp_path_factory):
    return make_hermes_checkpoint(random_checkpoints["qwen2"], tmp_path_factory.mktemp("hermes") / "qwen2-hermes")


@pytest.fixture(scope="module")
def server(model_dir):
    with run_server(stories_settings(model_dir, {"max_tool_calls": 3}, num_blocks=1024, max_num_seqs=64)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MODEL = "qwen2-hermes"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    population: int = pydantic.Field(ge=0, le=10_000)
    sights: list[pydantic.constr(max_length=6)] = pydantic.Field(max_length=2)
    capital: bool


def test_the_official_client_parses_a_pydantic_model(client):
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City,
                                                   temperature=temperature, seed=3, max_completion_tokens=200)
        message = completion.choices[0].message
        assert isinstance(message.parsed, City), message.content
        assert completion.choices[0].finish_reason == "stop"


def test_json_schema_streamed_with_several_samples_validates(client):
    schema = SCHEMAS["array_of_objects"]
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=11, max_completion_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "people", "schema": schema, "strict": True}})
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop"] * 3
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_vllm_guided_fields_on_both_endpoints(client):
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=2, n=8,
                                                max_completion_tokens=200, response_format={"type": "json_object"})
    ended = [c for c in completion.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(c.message.content), dict) for c in ended)
    assert all(c.finish_reason in ("stop", "length") and c.message.content.startswith("{") for c in completion.choices)
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0, n=3,
                                      extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert all(len(c.text) == 6 and c.text[3] == "-" and c.text[:3].isupper() for c in regex.choices)
    choice = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=1.0, n=3,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in choice.choices} <= {"yes", "no"}
    guided = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=0,
                                       extra_body={"guided_json": SCHEMAS["nested_object"]})
    jsonschema.validate(json.loads(guided.choices[0].text), SCHEMAS["nested_object"])
    vllm = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, temperature=0,
                                     extra_body={"structured_outputs": {"json": SCHEMAS["nested_object"]}})
    assert vllm.choices[0].text == guided.choices[0].text


def _call_args(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TOOL_SCHEMAS[call.function.name])
    return arguments


def test_tool_choice_required_returns_calls_whose_arguments_validate(client):
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2)):
        completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, SEARCH],
                                                    tool_choice="required", temperature=temperature, seed=seed,
                                                    max_completion_tokens=300)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            _call_args(call)
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, SEARCH],
                                            tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                            seed=5, n=3, max_completion_tokens=300)
    assert [len(c.message.tool_calls) for c in single.choices] == [1, 1, 1]


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, SEARCH], tool_choice="required", temperature=1.0,
                  seed=9, max_completion_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id is not None:
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_named_tool_choice_calls_that_function(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, SEARCH], temperature=1.0, seed=4, n=2,
        tool_choice={"type": "function", "function": {"name": "search"}}, max_completion_tokens=200)
    for choice in completion.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "search" and choice.finish_reason == "stop"  # OpenAI's reason for a named call
        _call_args(call)


def test_auto_renders_the_tools_and_a_tool_conversation_into_the_prompt(server, client):
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                max_completion_tokens=4, temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tool's schema is in the prompt
    assert with_tools.choices[0].message.tool_calls is None  # noise writes no <tool_call>: it is content
    conversation = [*MESSAGES,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answered = client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER],
                                              max_completion_tokens=4, temperature=0)
    assert answered.usage.prompt_tokens > with_tools.usage.prompt_tokens
    body = decode_body(json.dumps({"model": MODEL, "messages": conversation}).encode(), ChatCompletionRequest)
    rendered = server.state.tokenizer.chat_template.render(body.message_dicts(), True, [WEATHER])
    assert '<tool_call>{"arguments": {"location": "Paris"}, "name": "get_weather"}</tool_call>' in rendered
    assert "<tool_response>sunny, 21 C</tool_response>" in rendered and '"get_weather"' in rendered


def test_the_websocket_streams_constrained_json_and_tool_calls(server):
    url = server.url.replace("http://", "ws://") + "/v1/stream"
    schema = SCHEMAS["several_fields"]
    with websockets.sync.client.connect(url) as ws:
        ws.send(json.dumps({"type": "request", "id": "j", "body": {
            "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 200, "n": 2, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            "store": True}}))
        ws.send(json.dumps({"type": "request", "id": "t", "body": {
            "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 300, "tools": [WEATHER],
            "tool_choice": "required"}}))
        texts, arguments, done = {0: "", 1: ""}, {}, {}
        while len(done) < 2:
            message = json.loads(ws.recv(timeout=60))
            assert message["type"] != "error", message
            if message["type"] == "done":
                done[message["id"]] = message
            elif message["id"] == "j":
                for choice in message["choices"]:
                    texts[choice["index"]] += choice["delta"]["content"] or ""
            else:
                for part in message["choices"][0]["delta"].get("tool_calls", []):
                    arguments[part["index"]] = arguments.get(part["index"], "") + part["function"]["arguments"]
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)
    assert arguments
    for text in arguments.values():
        jsonschema.validate(json.loads(text), TOOL_SCHEMAS["get_weather"])
    assert done["j"]["ignored_fields"] == ["store"] and "ignored_fields" not in done["t"]


def test_a_small_pool_preempts_concurrent_constrained_streams_and_all_validate(model_dir):
    settings = stories_settings(model_dir, num_blocks=32, max_num_seqs=32)
    names = list(SCHEMAS)[:12]
    with run_server(settings) as small:
        results: dict[str, list[str]] = {}
        start = threading.Barrier(len(names))

        def ask(name: str) -> None:
            start.wait()
            body = {"model": MODEL, "messages": MESSAGES, "n": 3, "temperature": 1.0, "seed": 1,
                    "max_completion_tokens": 200,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[name]}}}
            reply = requests.post(small.url + "/v1/chat/completions", json=body, timeout=120).json()
            results[name] = [(c["finish_reason"], c["message"]["content"]) for c in reply["choices"]]

        threads = [threading.Thread(target=ask, args=(name,)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert small.state.bridge.engine.scheduler.num_preemptions > 0  # a count, read once all have ended
        small.wait_idle()
    for name in names:
        for reason, text in results[name]:
            assert reason == "stop", (name, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=30)


@pytest.mark.parametrize("change, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_structured_and_tool_input_is_a_400_naming_the_field(server, change, param):
    response = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | change)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    server.wait_idle()
