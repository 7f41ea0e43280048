"""Every response body and stream chunk matches OpenAI's published response shapes.

The schemas below are our own JSON Schemas, written from the facts of OpenAI's
createChatCompletion / createCompletion / listModels responses and its error body:
required fields, types, nullability and enums. Like OpenAI's, they allow extra fields
(prompt_tokens_details, max_model_len). Where OpenAI marks a field optional that we
always send (usage on whole responses, the four lists of a completion's logprobs), ours
requires it.
"""

import asyncio
import json

import pytest
import requests
import websockets
from jsonschema import Draft202012Validator

from tests.service.http import json_body, post, sse_chunks

INT, NUM, STR = {"type": "integer"}, {"type": "number"}, {"type": "string"}
NULLABLE_STR = {"type": ["string", "null"]}
CHAT_FINISH = ["stop", "length", "tool_calls", "content_filter", "function_call"]
COMPLETION_FINISH = ["stop", "length", "content_filter"]


def _obj(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


USAGE = _obj(["prompt_tokens", "completion_tokens", "total_tokens"], prompt_tokens=INT, completion_tokens=INT,
             total_tokens=INT, prompt_tokens_details={"type": "object", "properties": {"cached_tokens": INT}},
             completion_tokens_details={"type": "object"})
TOP_LOGPROB = _obj(["token", "logprob", "bytes"], token=STR, logprob=NUM,
                   bytes={"type": ["array", "null"], "items": INT})
TOKEN_LOGPROB = _obj(["token", "logprob", "bytes", "top_logprobs"], token=STR, logprob=NUM,
                     bytes={"type": ["array", "null"], "items": INT}, top_logprobs={"type": "array", "items": TOP_LOGPROB})
TOKEN_LOGPROBS = {"type": ["array", "null"], "items": TOKEN_LOGPROB}
CHAT_LOGPROBS = {"type": ["object", "null"], "required": ["content", "refusal"],
                 "properties": {"content": TOKEN_LOGPROBS, "refusal": TOKEN_LOGPROBS}}
MESSAGE = _obj(["role", "content", "refusal"], role={"const": "assistant"}, content=NULLABLE_STR, refusal=NULLABLE_STR)
CHAT_CHOICE = _obj(["index", "message", "logprobs", "finish_reason"], index=INT, message=MESSAGE,
                   logprobs=CHAT_LOGPROBS, finish_reason={"enum": CHAT_FINISH})
HEAD = {"id": STR, "created": INT, "model": STR, "system_fingerprint": STR, "service_tier": NULLABLE_STR}
CHAT_COMPLETION = _obj(["id", "object", "created", "model", "choices", "usage"], **HEAD,
                       object={"const": "chat.completion"}, choices={"type": "array", "items": CHAT_CHOICE}, usage=USAGE)
DELTA = {"type": "object", "properties": {
    "role": {"enum": ["developer", "system", "user", "assistant", "tool"]}, "content": NULLABLE_STR,
    "refusal": NULLABLE_STR}}
CHAT_CHUNK_CHOICE = _obj(["delta", "finish_reason", "index"], delta=DELTA, index=INT, logprobs=CHAT_LOGPROBS,
                         finish_reason={"enum": [*CHAT_FINISH, None]})
CHUNK_USAGE = {"anyOf": [{"type": "null"}, USAGE]}
CHAT_CHUNK = _obj(["id", "object", "created", "model", "choices"], **HEAD, object={"const": "chat.completion.chunk"},
                  choices={"type": "array", "items": CHAT_CHUNK_CHOICE}, usage=CHUNK_USAGE)
COMPLETION_LOGPROBS = {
    "type": ["object", "null"], "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {"tokens": {"type": "array", "items": STR}, "token_logprobs": {"type": "array", "items": NUM},
                   "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": NUM}},
                   "text_offset": {"type": "array", "items": INT}}}


def _completion_choice(finish: list) -> dict:
    return _obj(["text", "index", "logprobs", "finish_reason"], text=STR, index=INT, logprobs=COMPLETION_LOGPROBS,
                finish_reason={"enum": finish})


COMPLETION = _obj(["id", "object", "created", "model", "choices", "usage"], **HEAD, object={"const": "text_completion"},
                  choices={"type": "array", "items": _completion_choice(COMPLETION_FINISH)}, usage=USAGE)
COMPLETION_CHUNK = _obj(["id", "object", "created", "model", "choices"], **HEAD, object={"const": "text_completion"},
                        choices={"type": "array", "items": _completion_choice([*COMPLETION_FINISH, None])},
                        usage=CHUNK_USAGE)
MODEL_LIST = _obj(["object", "data"], object={"const": "list"}, data={"type": "array", "minItems": 1, "items": _obj(
    ["id", "object", "created", "owned_by"], id=STR, object={"const": "model"}, created=INT, owned_by=STR)})
ERROR = _obj(["error"], error=_obj(["message", "type", "param", "code"], message=STR, type=STR, param=NULLABLE_STR,
                                   code=NULLABLE_STR))
SCHEMAS = [USAGE, CHAT_COMPLETION, CHAT_CHUNK, COMPLETION, COMPLETION_CHUNK, MODEL_LIST, ERROR]

CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
COMPLETE = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}


def _check(instance, schema) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in Draft202012Validator(schema).iter_errors(instance)]
    assert not errors, f"{errors}\n{json.dumps(instance)[:2000]}"





@pytest.mark.parametrize("schema", SCHEMAS)
def test_our_schemas_are_valid_json_schemas(schema):
    Draft202012Validator.check_schema(schema)


def test_chat_json(server):
    _check(json_body(server, "/v1/chat/completions", CHAT | {"n": 2}), CHAT_COMPLETION)


def test_chat_json_with_logprobs_and_top_logprobs(server):
    body = json_body(server, "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 3})
    _check(body, CHAT_COMPLETION)
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == 6 and all(len(entry["top_logprobs"]) == 3 for entry in entries)


def test_chat_sse_without_usage(server):
    chunks = sse_chunks(server, "/v1/chat/completions", CHAT | {"n": 2, "logprobs": True})
    for chunk in chunks:
        _check(chunk, CHAT_CHUNK)
        assert "usage" not in chunk
    assert {c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"] == "length"} == {0, 1}


def test_chat_sse_with_usage(server):
    chunks = sse_chunks(server, "/v1/chat/completions", CHAT | {"n": 2, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        _check(chunk, CHAT_CHUNK)
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_completions_json_with_logprobs(server):
    body = json_body(server, "/v1/completions", COMPLETE | {"n": 2, "logprobs": 2})
    _check(body, COMPLETION)
    assert [len(c["logprobs"]["tokens"]) for c in body["choices"]] == [6, 6]


def test_completions_json_without_logprobs(server):
    body = json_body(server, "/v1/completions", COMPLETE)
    _check(body, COMPLETION)
    assert body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("include_usage", [False, True])
def test_completions_sse(server, include_usage):
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = sse_chunks(server, "/v1/completions", COMPLETE | {"n": 2, "logprobs": 1} | extra)
    for chunk in chunks:
        _check(chunk, COMPLETION_CHUNK)
        assert ("usage" in chunk) == include_usage
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5 + 12


def test_list_models(server):
    response = requests.get(server.url + "/v1/models", timeout=10)
    assert response.status_code == 200
    _check(response.json(), MODEL_LIST)
    assert response.json()["data"][0]["id"] == "stories260K"


def test_error_body_of_a_400(server):
    response = post(server, "/v1/chat/completions", CHAT | {"max_tokens": "5"})
    assert response.status_code == 400
    _check(response.json(), ERROR)
    assert response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT | {"model": "gpt-9"}), ("/v1/nothing", CHAT)])
def test_error_body_of_a_404(server, path, body):
    response = post(server, path, body)
    assert response.status_code == 404
    _check(response.json(), ERROR)


def test_websocket_chunks_are_chat_chunks(server):
    """A /v1/stream chunk is a chat chunk whose `id` is the client's, the completion id moved to `completion_id`."""
    async def main():
        url = server.url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(url) as ws:
            body = CHAT | {"n": 2, "logprobs": True, "top_logprobs": 1}
            await ws.send(json.dumps({"type": "request", "id": "r1", "body": body}))
            messages = []
            while not messages or messages[-1]["type"] != "done":
                messages.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return messages

    messages = asyncio.run(main())
    chunks, done = messages[:-1], messages[-1]
    assert chunks and all(m["type"] == "chunk" and m["id"] == "r1" for m in chunks)
    for message in chunks:
        chunk = {k: v for k, v in message.items() if k not in ("type", "id", "completion_id")}
        _check(chunk | {"id": message["completion_id"]}, CHAT_CHUNK)
    assert len({m["completion_id"] for m in chunks}) == 1 and chunks[0]["completion_id"].startswith("chatcmpl-")
    _check(done["usage"], USAGE)
    assert done["finish_reasons"] == ["length", "length"]
