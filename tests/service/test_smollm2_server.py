"""`pagedserve serve --model SmolLM2-135M-Instruct.Q4_1.gguf` (what `make run` serves), through the
official openai client: a chat answer, structured outputs and tool calls on a real chat model."""

import json

import jsonschema
import openai
import pytest

from tests.processes import Process

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-server")
    process = Process("smollm2", ["serve", "--model", str(smollm2_gguf), "--port", "0"], 0, folder,
                      {"PAGEDSERVE_SERVER_DATA_DIR": str(folder / "data"), "PAGEDSERVE_ENGINE_NUM_BLOCKS": "256"})
    process.wait_ready(timeout=180)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_serves_the_chat_model_under_its_file_name(client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    # (the capital of France opens on a near-tie this file's greedy answer turns with the kernels' rounding:
    # llama-server answers "L'Étoile, ...", and so do we: tests/runtime/test_smollm2.py)
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=40,
                                         messages=[{"role": "user", "content": "Name three primary colors."}])
    assert all(color in out.choices[0].message.content for color in ("Red", "Blue", "Yellow")), out.choices[0]
    assert out.choices[0].finish_reason == "stop"  # <|im_end|> from the GGUF's metadata ends the turn


def test_structured_output_follows_the_schema(client):
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Which city is the capital of Italy? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, CITY)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_has_valid_arguments(client, tool_choice):
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=80, tools=[WEATHER_TOOL],
        tool_choice=tool_choice, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    calls = out.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    # as OpenAI answers: "tool_calls" when the model chose to call, "stop" when the call was named for it
    assert out.choices[0].finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
