"""Speculative decoding through the server: the official clients see the same answers, faster or not.

A server with `speculative_config` (ngram) beside the plain one, both on stories260K: chat and
completions (JSON and SSE) and the WebSocket give the same greedy text; OpenAI's `prediction`
drafts on either server and usage reports what it kept; /metrics has vLLM's counters.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import requests
import websockets

from runtime.speculative import speculator
from tests.service.conftest import run_server, stories_settings
from tests.service.http import post

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
STORY = "Lily and Tom went to the park. Lily and Tom saw a big tree. Lily and Tom"
MESSAGES = [{"role": "user", "content": STORY}]


@pytest.fixture(scope="module")
def spec_server(stories_dir):
    # drafts as many as allowed: the policy's cut depends on the clock, and these tests count drafts
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculator, "plan_drafts", lambda gains, *rest: [len(g) for g in gains])
        with run_server(stories_settings(stories_dir, speculative_config=NGRAM)) as running:
            yield running


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _metrics(server) -> dict[str, float]:
    values = {}
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_chat_and_completions_give_the_same_text_with_speculation(server, spec_server):
    texts = {}
    for name, running in (("plain", server), ("spec", spec_server)):
        client = _client(running)
        chat = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=40, temperature=0)
        streamed = client.completions.create(model="stories260K", prompt=STORY, max_tokens=40, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        texts[name] = (chat.choices[0].message.content, "".join(c.choices[0].text for c in chunks if c.choices),
                       chunks[-1].usage.completion_tokens)
    assert texts["spec"] == texts["plain"]
    metrics = _metrics(spec_server)
    assert metrics['vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="stories260K"}'] > 0
    accepted = metrics['vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="stories260K"}']
    per_position = [v for k, v in metrics.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")]
    assert accepted > 0 and sum(per_position) == accepted and len(per_position) >= 4
    spec_server.wait_idle()


def test_the_websocket_streams_the_same_text(server, spec_server):
    async def ask(running) -> str:
        url = running.url.replace("http://", "ws://") + "/v1/stream"
        body = {"model": "stories260K", "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "request", "id": "a", "body": body}))
            text = ""
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if message["type"] == "chunk":
                    text += "".join(c["delta"].get("content") or "" for c in message["choices"])
                elif message["type"] == "done":
                    return text

    assert asyncio.run(ask(spec_server)) == asyncio.run(ask(server))


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_a_prediction_drafts_and_usage_counts_what_was_kept(server, spec_server, which):
    running = spec_server if which == "spec" else server
    client = _client(running)
    plain = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=40, temperature=0)
    answer = plain.choices[0].message.content
    predicted = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=40, temperature=0,
                                               prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0  # how many is the timed cost model's call (fewer on a loaded machine)
    num_predicted = len(running.state.engine.tokenizer.encode(answer, add_special_tokens=False))
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == num_predicted
    wrong = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=40, temperature=0,
                                           prediction={"type": "content",
                                                       "content": [{"type": "text", "text": "Zebras hum quietly."}]})
    assert wrong.choices[0].message.content == answer  # a wrong prediction costs time, never the answer
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens < 3
    assert "completion_tokens_details" not in plain.usage.model_dump(exclude_none=True)
    running.wait_idle()


@pytest.mark.parametrize("prediction", [{"type": "file", "content": "x"}, {"type": "content", "content": 5},
                                        {"type": "content", "content": [{"type": "image_url", "image_url": {}}]},
                                        "text"])
def test_a_malformed_prediction_is_a_400_naming_it(server, prediction):
    response = post(server, "/v1/chat/completions", {"model": "stories260K", "messages": MESSAGES,
                                                     "prediction": prediction})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prediction"


def test_the_dashboard_payload_carries_each_sequences_drafts(stories_dir):
    from runtime import Engine, SamplingParams
    from service.api.dashboard import compact_page_map

    engine = Engine.from_pretrained(stories_dir)
    prompt = engine.tokenizer.encode(STORY)
    answer = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0].outputs[0].token_ids
    engine.add_request("d", prompt, SamplingParams(max_tokens=30, temperature=0), prediction=answer)
    seq = engine.requests["d"].sequences[0]
    while seq.num_output_tokens < 8:
        engine.step()
    [row] = compact_page_map(engine.page_map(), "stories260K", engine.max_model_len)["seqs"]
    drafted, accepted = row[8], row[9]
    assert drafted > 0 and accepted == engine.speculator.drafting(seq.seq_id).num_accepted_tokens > 0
    engine.abort_request("d")
    engine.step()


def test_a_draft_model_server_streams_the_same_text(server, stories_dir, tmp_path_factory):
    """`draft_model` through the server: SSE chat gives the plain server's text; the counters show its drafts."""
    from tests.runtime.speculative.engine_helpers import first_layers_checkpoint

    draft = first_layers_checkpoint(stories_dir, tmp_path_factory.mktemp("draft") / "stories-2l", 2)
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}

    def streamed(running) -> str:
        chunks = _client(running).chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=40,
                                                         temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculator, "plan_drafts", lambda gains, *rest: [len(g) for g in gains])
        with run_server(stories_settings(stories_dir, speculative_config=config)) as running:
            assert streamed(running) == streamed(server)
            metrics = _metrics(running)
            running.wait_idle()
    assert metrics['vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="stories260K"}'] > 0
    assert metrics['vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="stories260K"}'] > 0
