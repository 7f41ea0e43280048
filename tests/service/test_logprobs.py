"""Logprob tokens spell the text, with the real stories260K model.

A choice's tokens, joined, are its text; each completions `text_offset` points at its
token; each chat `bytes` is its token's UTF-8. This holds for JSON and SSE (offsets keep
counting across chunks), with n > 1, with stop strings (the text cut) and at max_tokens.
"""


import pytest

from tests.service.http import json_body, sse_chunks

COMPLETE = {"model": "stories260K", "prompt": "Once upon a time", "temperature": 0}
CHAT = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "logprobs": True}




def _check_completion(choice: dict) -> None:
    text, logprobs = choice["text"], choice["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert all(text[offset:offset + len(token)] == token for token, offset in zip(tokens, offsets))
    assert len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(tokens)


def _check_chat(content: str, entries: list[dict]) -> None:
    assert "".join(entry["token"] for entry in entries) == content
    for entry in entries:
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert all(top["bytes"] == list(top["token"].encode("utf-8")) for top in entry["top_logprobs"])


def _merge_completion_stream(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: the streamed text and the concatenated logprob lists, as a JSON choice reads."""
    merged: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            whole = merged.setdefault(choice["index"], {"text": "", "finish_reason": None, "logprobs": {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}})
            whole["text"] += choice["text"]
            whole["finish_reason"] = choice["finish_reason"] or whole["finish_reason"]
            for key, values in choice["logprobs"].items():
                whole["logprobs"][key] += values
    return merged


def test_bug_report_case_tokens_spell_the_text(server):
    body = json_body(server, "/v1/completions", COMPLETE | {"max_tokens": 5, "logprobs": 0})
    choice = body["choices"][0]
    assert choice["text"].startswith(", there was")
    _check_completion(choice)
    assert choice["logprobs"]["tokens"] == [",", " there", " was", " a", " little"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 7, 11, 13]
    # logprobs 0: no alternatives, but the sampled token is always there (as OpenAI: up to logprobs + 1)
    assert [list(top) for top in choice["logprobs"]["top_logprobs"]] == [[t] for t in choice["logprobs"]["tokens"]]
    assert [top[t] for top, t in zip(choice["logprobs"]["top_logprobs"], choice["logprobs"]["tokens"])] == \
        choice["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("prompt", ["Once upon a time", ""])  # "": the first token starts the text, no space
def test_completion_top_logprobs_name_the_greedy_choice_as_in_the_text(server, prompt):
    body = COMPLETE | {"prompt": prompt, "max_tokens": 12, "logprobs": 3}
    logprobs = json_body(server, "/v1/completions", body)["choices"][0]["logprobs"]
    for token, chosen, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == 3 and top[token] == max(top.values()) == chosen <= 0


def test_max_tokens_reached_gives_one_token_per_completion_token(server):
    body = json_body(server, "/v1/completions", COMPLETE | {"max_tokens": 40, "logprobs": 1, "ignore_eos": True})
    choice = body["choices"][0]
    _check_completion(choice)
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == body["usage"]["completion_tokens"] == 40


def test_n_choices_each_spell_their_text(server):
    body = json_body(server, "/v1/completions", COMPLETE | {"max_tokens": 30, "temperature": 1.0, "seed": 3, "n": 3,
                                                        "logprobs": 2})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        _check_completion(choice)


@pytest.mark.parametrize("stop, text, tokens", [
    ("ther", ", ", [",", " "]),  # the cut falls inside " there": that token keeps what is left of it
    (" was", ", there", [",", " there", ""]),  # " was" is cut whole: its token stays, with no text
])
def test_stop_string_cuts_the_tokens_with_the_text(server, stop, text, tokens):
    body = json_body(server, "/v1/completions", COMPLETE | {"max_tokens": 10, "logprobs": 0, "stop": stop})
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text, "stop")
    _check_completion(choice)
    assert choice["logprobs"]["tokens"] == tokens
    assert body["usage"]["completion_tokens"] == len(tokens)


@pytest.mark.parametrize("extra, finish", [
    ({}, "length"), ({"stop": " named"}, "stop"), ({"n": 2, "temperature": 1.0, "seed": 11, "ignore_eos": True}, "length"),
])
def test_completion_stream_offsets_count_across_chunks(server, extra, finish):
    body = COMPLETE | {"max_tokens": 24, "logprobs": 1} | extra
    chunks = sse_chunks(server, "/v1/completions", body)
    streamed = _merge_completion_stream(chunks)
    whole = {c["index"]: c for c in json_body(server, "/v1/completions", body)["choices"]}
    assert sorted(streamed) == sorted(whole)
    for index, choice in streamed.items():
        _check_completion(choice)
        assert choice["text"] == whole[index]["text"]
        assert choice["finish_reason"] == whole[index]["finish_reason"] == finish
        assert choice["logprobs"]["tokens"] == whole[index]["logprobs"]["tokens"]
        assert choice["logprobs"]["text_offset"] == whole[index]["logprobs"]["text_offset"]
    if len(streamed) == 1:
        assert len(chunks) > 2  # the offsets really did span several chunks


def test_chat_tokens_spell_the_content_and_bytes_are_utf8(server):
    body = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": 20, "top_logprobs": 2})
    choice = body["choices"][0]
    entries = choice["logprobs"]["content"]
    _check_chat(choice["message"]["content"], entries)
    assert len(entries) == body["usage"]["completion_tokens"] == 20
    assert choice["logprobs"]["refusal"] is None
    for entry in entries:
        best = entry["top_logprobs"][0]
        assert len(entry["top_logprobs"]) == 2 and (best["token"], best["logprob"]) == (entry["token"], entry["logprob"])


def test_chat_with_a_stop_string(server):
    whole = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": 20})["choices"][0]["message"]["content"]
    stop = whole[3:6]  # cut inside the text; the stop string is not in what comes back
    choice = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": 20, "stop": stop})["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == whole[: whole.index(stop)]
    _check_chat(choice["message"]["content"], choice["logprobs"]["content"])


def test_chat_n_choices_each_spell_their_content(server):
    body = json_body(server, "/v1/chat/completions", CHAT | {"max_tokens": 25, "temperature": 1.0, "seed": 5, "n": 3})
    for choice in body["choices"]:
        _check_chat(choice["message"]["content"], choice["logprobs"]["content"])


def test_chat_stream_tokens_spell_the_streamed_content(server):
    body = CHAT | {"max_tokens": 20, "n": 2, "top_logprobs": 1, "temperature": 1.0, "seed": 2}
    content: dict[int, str] = {}
    entries: dict[int, list] = {}
    for chunk in sse_chunks(server, "/v1/chat/completions", body):
        for choice in chunk["choices"]:
            content[choice["index"]] = content.get(choice["index"], "") + choice["delta"]["content"]
            entries.setdefault(choice["index"], []).extend(choice["logprobs"]["content"])
    whole = json_body(server, "/v1/chat/completions", body)["choices"]
    assert sorted(content) == [0, 1]
    for choice in whole:
        index = choice["index"]
        _check_chat(content[index], entries[index])
        assert content[index] == choice["message"]["content"]
        assert [e["token"] for e in entries[index]] == [e["token"] for e in choice["logprobs"]["content"]]


def test_a_character_split_across_byte_tokens_spreads_its_bytes_over_them(stories_dir):
    """Formatting alone, on stories260K's tokenizer: "日" is three byte-fallback tokens."""
    from runtime.detokenizer import IncrementalDetokenizer
    from runtime.outputs import TokenLogprob
    from runtime.tokenizer import HFTokenizer
    from service.api.formatting import ChatFormat

    tokenizer = HFTokenizer(stories_dir)
    prompt = tokenizer.encode("Once")
    output = tokenizer.encode("日 a", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    for token_id in output:
        detokenizer.append(token_id)
    detokenizer.take_new_text(finished=True)
    texts = detokenizer.take_token_texts(finished=True)
    assert [i for i, _ in texts] == list(range(len(output)))
    tokens = [TokenLogprob(output[i], text, {output[i]: -0.5}) for i, text in texts]
    content = ChatFormat("chatcmpl-x", 0, "stories260K", tokenizer, 0).logprobs(tokens)["content"]
    assert "".join(entry["token"] for entry in content) == detokenizer.text == " 日 a"  # SentencePiece's space
    byte_tokens = [entry for t, entry in zip(output, content) if tokenizer.raw_byte(t) is not None]
    assert [entry["bytes"] for entry in byte_tokens] == [[b] for b in "日".encode()]
    assert [entry["token"] for entry in byte_tokens] == ["", "", "日"]  # the last byte completes it
    assert bytes(b for entry in content for b in entry["bytes"]) == " 日 a".encode()
