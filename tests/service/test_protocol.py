"""Request bodies as OpenAI's spec reads them, against the real stories260K model.

`null` in an optional field means its default; a whole number sent as a float is that
integer (`"seed": 7.0`), while `7.5` and `"7"` are a 400 naming the field; `top_p: 0` keeps
only the most probable token; `max_tokens: 0` generates nothing (finish_reason "length",
the prompt still counted).
"""


import pytest

from tests.service.conftest import run_server, stories_settings
from tests.service.http import json_body, post, sse_chunks

COMPLETE = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "seed": 4}
CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "seed": 4}
GREEDY = {"temperature": 0}





def _result(server, path, body) -> tuple[list[dict], dict]:
    """What must match between two equivalent requests: the choices and the usage (not the id or time)."""
    response = json_body(server, path, body)
    return response["choices"], response["usage"]


COMPLETION_NULLS = ["n", "stream", "echo", "temperature", "top_p", "stop", "logprobs", "presence_penalty",
                    "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                    "stop_token_ids", "include_stop_str_in_output", "cache_salt", "prompt_cache_key",
                    "stream_options", "min_tokens"]
CHAT_NULLS = [f for f in COMPLETION_NULLS if f != "echo"] + ["top_logprobs", "max_completion_tokens"]


@pytest.mark.parametrize("field", COMPLETION_NULLS)
def test_completion_null_field_is_its_default(server, field):
    expected = _result(server, "/v1/completions", COMPLETE)
    assert _result(server, "/v1/completions", COMPLETE | {field: None}) == expected


@pytest.mark.parametrize("field", CHAT_NULLS)
def test_chat_null_field_is_its_default(server, field):
    expected = _result(server, "/v1/chat/completions", CHAT)
    assert _result(server, "/v1/chat/completions", CHAT | {field: None}) == expected


def test_null_seed_is_no_seed(server):
    body = COMPLETE | GREEDY
    assert _result(server, "/v1/completions", body | {"seed": None}) == _result(server, "/v1/completions", body)


def test_null_message_content_and_name_are_empty_and_absent(server):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    expected = _result(server, "/v1/chat/completions", CHAT | {"messages": messages})
    messages = [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": None}]
    assert _result(server, "/v1/chat/completions", CHAT | {"messages": messages}) == expected


def test_null_prompt_is_the_empty_document(server):
    choices, usage = _result(server, "/v1/completions", COMPLETE | GREEDY | {"prompt": None})
    assert (choices, usage) == _result(server, "/v1/completions", COMPLETE | GREEDY | {"prompt": ""})
    assert usage["prompt_tokens"] == 1  # the BOS token alone


def test_null_max_tokens_is_16_for_completions(server):
    usage = json_body(server, "/v1/completions", COMPLETE | {"max_tokens": None, "ignore_eos": True})["usage"]
    assert usage["completion_tokens"] == 16


def test_null_max_tokens_is_the_rest_of_the_context_for_chat(server):
    usage = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": None, "ignore_eos": True})["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == server.state.engine.max_model_len


def test_null_include_usage_sends_no_usage_chunk(server):
    chunks = sse_chunks(server, "/v1/completions", COMPLETE | {"stream_options": {"include_usage": None}})
    assert chunks and all("usage" not in chunk and chunk["choices"] for chunk in chunks)


@pytest.mark.parametrize("path, base, field, whole, integer", [
    ("/v1/completions", COMPLETE, "seed", 7.0, 7),
    ("/v1/completions", COMPLETE, "n", 2.0, 2),
    ("/v1/completions", COMPLETE, "max_tokens", 5.0, 5),
    ("/v1/completions", COMPLETE, "logprobs", 4.0, 4),
    ("/v1/completions", COMPLETE, "top_k", 3.0, 3),
    ("/v1/completions", COMPLETE, "stop_token_ids", [2.0], [2]),
    ("/v1/completions", COMPLETE, "prompt", [1.0, 9.0, 40.0], [1, 9, 40]),
    ("/v1/completions", COMPLETE, "prompt", [[1.0, 9.0], [1.0, 40.0]], [[1, 9], [1, 40]]),
    ("/v1/chat/completions", CHAT | {"logprobs": True}, "top_logprobs", 2.0, 2),
    ("/v1/chat/completions", CHAT | {"max_tokens": None}, "max_completion_tokens", 5.0, 5),
    ("/v1/chat/completions", CHAT, "n", 3.0, 3),
])
def test_whole_float_is_that_integer(server, path, base, field, whole, integer):
    assert _result(server, path, base | {field: whole}) == _result(server, path, base | {field: integer})


@pytest.mark.parametrize("path, base, field, value, param", [
    ("/v1/completions", COMPLETE, "seed", 7.5, "seed"),
    ("/v1/completions", COMPLETE, "seed", "7", "seed"),
    ("/v1/completions", COMPLETE, "n", 1.5, "n"),
    ("/v1/completions", COMPLETE, "n", True, "n"),
    ("/v1/completions", COMPLETE, "max_tokens", 5.5, "max_tokens"),
    ("/v1/completions", COMPLETE, "max_tokens", "5", "max_tokens"),
    ("/v1/completions", COMPLETE, "logprobs", 0.5, "logprobs"),
    ("/v1/completions", COMPLETE, "logprobs", "1", "logprobs"),
    ("/v1/completions", COMPLETE, "top_k", 2.5, "top_k"),
    ("/v1/completions", COMPLETE, "stop_token_ids", [2.5], "stop_token_ids[0]"),
    ("/v1/completions", COMPLETE, "prompt", [1, 9.5], "prompt"),
    ("/v1/completions", COMPLETE, "temperature", "0", "temperature"),
    ("/v1/chat/completions", CHAT | {"logprobs": True}, "top_logprobs", 1.5, "top_logprobs"),
    ("/v1/chat/completions", CHAT | {"max_tokens": None}, "max_completion_tokens", "5", "max_completion_tokens"),
    ("/v1/chat/completions", CHAT, "logprobs", 1.0, "logprobs"),
    ("/v1/completions", COMPLETE, "min_tokens", 9, "min_tokens"),  # past max_tokens (8)
    ("/v1/chat/completions", CHAT, "min_tokens", -1, "min_tokens"),
])
def test_non_whole_float_or_string_is_a_400_naming_the_field(server, path, base, field, value, param):
    response = post(server, path, base | {field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize("path, base, text", [
    ("/v1/completions", COMPLETE, lambda choice: choice["text"]),
    ("/v1/chat/completions", CHAT, lambda choice: choice["message"]["content"]),
])
def test_top_p_zero_is_greedy(server, path, base, text):
    body = base | {"max_tokens": 20, "ignore_eos": True}
    greedy = text(json_body(server, path, body | GREEDY)["choices"][0])
    choices = json_body(server, path, body | {"temperature": 1.5, "top_p": 0, "n": 4, "seed": 9})["choices"]
    assert [text(choice) for choice in choices] == [greedy] * 4


def test_max_tokens_zero_completion_json(server):
    body = json_body(server, "/v1/completions", COMPLETE | {"max_tokens": 0, "logprobs": 1})
    assert body["choices"] == [{"index": 0, "text": "", "finish_reason": "length", "logprobs": {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_max_tokens_zero_completion_sse(server):
    chunks = sse_chunks(server, "/v1/completions", COMPLETE | {"max_tokens": 0, "stream_options": {"include_usage": True}})
    assert [chunk["choices"] for chunk in chunks] == [
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}], []]
    assert chunks[0]["usage"] is None
    assert chunks[1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_zero_chat_json(server, field):
    prompt_tokens = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": 1})["usage"]["prompt_tokens"]
    body = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": None, field: 0})
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "", "refusal": None},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_max_tokens_zero_chat_sse(server):
    chunks = sse_chunks(server, "/v1/chat/completions", CHAT | {"max_tokens": 0, "logprobs": True})
    assert [chunk["choices"] for chunk in chunks] == [[{
        "index": 0, "delta": {"role": "assistant", "content": "", "refusal": None},
        "logprobs": {"content": [], "refusal": None}, "finish_reason": "length"}]]


def test_max_tokens_zero_with_n_2_gives_two_empty_choices(stories_dir):
    with run_server(stories_settings(stories_dir)) as own:
        body = post(own, "/v1/completions", COMPLETE | {"max_tokens": 0, "n": 2}, timeout=3).json()
        assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
            (0, "", "length"), (1, "", "length")]
        assert body["usage"]["completion_tokens"] == 0


def test_min_tokens_holds_the_stop_back(server):
    """A stop string the greedy text has early ends the output there, unless min_tokens holds it back."""
    body = COMPLETE | GREEDY | {"max_tokens": 20, "ignore_eos": True}
    text = json_body(server, "/v1/completions", body)["choices"][0]["text"]
    stop = text[1:7]
    early = json_body(server, "/v1/completions", body | {"stop": [stop]})["choices"][0]
    held = json_body(server, "/v1/completions", body | {"stop": [stop], "min_tokens": 12})["choices"][0]
    assert early["finish_reason"] == "stop" and len(early["text"]) < 2
    assert held["text"].startswith(text[:7]) and held["finish_reason"] in ("length", "stop")
