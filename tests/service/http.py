"""HTTP calls the service tests share: a POST, its JSON body, an SSE stream's events."""

import json

import requests


def post(server, path: str, body: dict, timeout: float = 30) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=timeout)


def json_body(server, path: str, body: dict) -> dict:
    """The 200 response's JSON body (the test fails with the body's text otherwise)."""
    response = post(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON events of the request streamed (`stream: true`); the stream must end with data: [DONE]."""
    response = post(server, path, body | {"stream": True})
    assert response.status_code == 200, response.text
    events = [block.removeprefix("data: ") for block in response.content.decode("utf-8").split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]
