"""Bad input gets the OpenAI error shape with the right status and param; never a 500."""

import json

import pytest
import requests

from tests.service.conftest import run_server, stories_settings


def _post(server, path, body, raw=False, **kwargs):
    data = body if raw else json.dumps(body)
    return requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30, **kwargs)


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def test_unknown_model_is_404(server):
    error = _error(_post(server, "/v1/chat/completions", CHAT | {"model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_bad_json_is_400(server):
    error = _error(_post(server, "/v1/chat/completions", b"{not json", raw=True), 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "change, param",
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"frequency": 1}, "frequency"),  # unknown fields stay 400
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_fields_are_400_naming_the_param(server, change, param):
    error = _error(_post(server, "/v1/chat/completions", CHAT | change), 400)
    assert error["param"] == param


def test_completion_prompt_of_bad_shape_is_400(server):
    for prompt in ([1, "a"], [], [[1, 2], "x"], [1, 99999]):
        error = _error(_post(server, "/v1/completions", {"model": "stories260K", "prompt": prompt}), 400)
        assert error["param"] == "prompt"


def test_context_length_exceeded(server):
    body = {"model": "stories260K", "prompt": [1] * 400, "max_tokens": 200}
    error = _error(_post(server, "/v1/completions", body), 400)
    assert error["code"] == "context_length_exceeded"


def test_body_over_the_limit_is_413(server):
    body = {"model": "stories260K", "prompt": "x" * (2 * 1024 * 1024)}
    error = _error(_post(server, "/v1/completions", body), 413)
    assert error["code"] == "request_too_large"


def test_unknown_route_and_wrong_method_keep_the_shape(server):
    _error(requests.get(server.url + "/v1/nothing", timeout=10), 404)
    _error(requests.get(server.url + "/v1/chat/completions", timeout=10), 405)


def test_engine_failure_mid_stream_sends_an_error_event_then_done(stories_dir):
    from service.app import load_engine

    def failing_engine(settings):
        engine = load_engine(settings)
        real_step = engine.step
        calls = {"n": 0}

        def step():
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("simulated kernel failure")
            return real_step()

        engine.step = step
        return engine

    with run_server(stories_settings(stories_dir), failing_engine) as server:
        body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 20, "stream": True}
        response = _post(server, "/v1/completions", body, stream=True)
        events = [line for line in response.iter_lines() if line]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][len(b"data: "):])["error"]["code"] == "internal_error"
        assert len(events) >= 3  # some tokens came before the failure
        server.wait_idle()
        ok = _post(server, "/v1/completions", {"model": "stories260K", "prompt": "Hi", "max_tokens": 3})
        assert ok.status_code == 200  # the engine keeps serving
