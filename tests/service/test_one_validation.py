"""Each request is validated once (RequestBuilder.prepare_request, on the loop): the same error on every
path.

A prompt too long for the context, token ids outside the vocabulary and an empty prompt get
one error body, whether the request came as JSON, as an SSE stream or over the WebSocket,
and nothing reaches the engine.
"""

import asyncio
import json

import requests
import websockets

LONG = "Once upon a time there was a little girl named Lily. " * 40  # far past stories260K's context


def _http_error(server, path: str, body: dict) -> tuple[int, dict]:
    response = requests.post(server.url + path, json=body, timeout=30)
    return response.status_code, response.json()["error"]


def _ws_error(server, body: dict) -> dict:
    async def main():
        async with websockets.connect(server.url.replace("http://", "ws://") + "/v1/stream") as ws:
            await ws.send(json.dumps({"type": "request", "id": "r1", "body": body}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    message = asyncio.run(main())
    assert message["type"] == "error" and message["id"] == "r1"
    return message["error"]


def test_a_chat_past_the_context_gets_one_error_on_json_sse_and_websocket(server):
    body = {"model": "stories260K", "messages": [{"role": "user", "content": LONG}]}
    json_status, json_error = _http_error(server, "/v1/chat/completions", body)
    sse_status, sse_error = _http_error(server, "/v1/chat/completions", {**body, "stream": True})
    ws_error = _ws_error(server, body)
    assert json_status == sse_status == 400
    assert json_error == sse_error == ws_error
    assert (json_error["code"], json_error["param"], json_error["type"]) == (
        "context_length_exceeded", "messages", "invalid_request_error")
    assert "maximum context length is" in json_error["message"]


def test_max_tokens_past_the_context_names_the_prompt_field(server):
    short = {"model": "stories260K", "max_tokens": 100_000}
    chat = _http_error(server, "/v1/chat/completions", {**short, "messages": [{"role": "user", "content": "Hi"}]})
    text = _http_error(server, "/v1/completions", {**short, "prompt": "Hi", "stream": True})
    assert chat[0] == text[0] == 400
    assert (chat[1]["code"], chat[1]["param"]) == ("context_length_exceeded", "messages")
    assert (text[1]["code"], text[1]["param"]) == ("context_length_exceeded", "prompt")


def test_bad_token_ids_and_empty_prompts_are_refused_before_the_engine(server):
    before = server.state.bridge.stats["prefix_cache_queries"]
    for prompt in ([1, 2, 10**9], [[1, 2], [-1]], []):
        status, error = _http_error(server, "/v1/completions", {"model": "stories260K", "prompt": prompt})
        assert (status, error["param"]) == (400, "prompt"), prompt
    server.wait_idle()
    assert server.state.bridge.stats["prefix_cache_queries"] == before  # nothing was scheduled
