"""GET /v1/stream with the `websockets` client: many requests per socket, cancel by id."""

import asyncio
import json
import time

import websockets


def _ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/stream"


def _request(request_id: str, content: str, **extra) -> str:
    body = {"model": "stories260K", "messages": [{"role": "user", "content": content}], "temperature": 0} | extra
    return json.dumps({"type": "request", "id": request_id, "body": body})


async def _collect(ws, until_done: set[str]) -> dict[str, list[dict]]:
    events: dict[str, list[dict]] = {}
    while until_done:
        message = json.loads(await asyncio.wait_for(ws.recv(), 30))
        events.setdefault(message["id"], []).append(message)
        if message["type"] in ("done", "error"):
            until_done.discard(message["id"])
    return events


def test_concurrent_requests_on_one_socket(server):
    async def main():
        async with websockets.connect(_ws_url(server)) as ws:
            for i in range(4):
                await ws.send(_request(f"r{i}", f"Story {i}", max_tokens=10 + i))
            return await _collect(ws, {f"r{i}" for i in range(4)})

    events = asyncio.run(main())
    for i in range(4):
        chunks = [e for e in events[f"r{i}"] if e["type"] == "chunk"]
        done = events[f"r{i}"][-1]
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 10 + i
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[0]["object"] == "chat.completion.chunk"
    server.wait_idle()


def test_cancel_stops_one_request_and_reports_its_usage(server):
    async def main():
        async with websockets.connect(_ws_url(server)) as ws:
            await ws.send(_request("long", "A long story", max_tokens=400, ignore_eos=True))
            await ws.send(_request("short", "Hi", max_tokens=5))
            seen_long = 0
            events = []
            while True:
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                events.append(message)
                if message["id"] == "long" and message["type"] == "chunk":
                    seen_long += 1
                    if seen_long == 3:
                        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
                if message["id"] == "long" and message["type"] == "done":
                    break
            return events

    events = asyncio.run(main())
    done = [e for e in events if e["id"] == "long" and e["type"] == "done"][0]
    assert done["finish_reasons"] == ["abort"]
    assert 3 <= done["usage"]["completion_tokens"] < 400
    server.wait_idle()


def test_bad_messages_get_error_events_and_the_socket_stays_open(server):
    async def main():
        async with websockets.connect(_ws_url(server)) as ws:
            await ws.send("{nope")
            bad_json = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "request", "id": "x", "body": {"model": "nope", "messages": []}}))
            bad_model = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "cancel", "id": "ghost"}))
            ghost = json.loads(await ws.recv())
            await ws.send(_request("ok", "Hi", max_tokens=3))
            ok = await _collect(ws, {"ok"})
            return bad_json, bad_model, ghost, ok

    bad_json, bad_model, ghost, ok = asyncio.run(main())
    assert bad_json["type"] == "error" and bad_json["id"] is None
    assert bad_model["type"] == "error" and bad_model["error"]["code"] == "model_not_found"
    assert ghost["type"] == "error" and ghost["id"] == "ghost"
    assert ok["ok"][-1]["type"] == "done"


def _num_aborted(server) -> float:
    return server.state.metrics.requests.labels(finished_reason="abort")._value.get()


def test_closing_the_socket_aborts_its_requests(server):
    server.wait_idle()
    aborted_before = _num_aborted(server)
    # The whole rest of the context, every token (ignore_eos): far more than the one chunk read before closing.
    num_prompt_tokens = len(server.state.tokenizer.apply_chat_template([{"role": "user", "content": "Go"}]))
    max_tokens = server.state.engine.max_model_len - num_prompt_tokens

    async def main():
        async with websockets.connect(_ws_url(server)) as ws:
            for i in range(3):
                await ws.send(_request(f"c{i}", "Go", max_tokens=max_tokens, ignore_eos=True))
            streaming = set()
            while len(streaming) < 3:  # all three are in the engine (one not yet read is cancelled unstarted)
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                if message["type"] == "chunk":
                    streaming.add(message["id"])

    with server.counting_engine_tokens() as generated:
        asyncio.run(main())
        deadline = time.monotonic() + 30  # a safety net: the wait ends as soon as all three are counted
        while _num_aborted(server) - aborted_before < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.wait_idle(timeout=30)
    assert _num_aborted(server) - aborted_before == 3  # ended as aborts, not run out to finish_reason "length"
    assert generated.value < max_tokens  # and the engine stopped: a third of what running them out would take


def test_cancel_in_the_same_packet_as_the_request_still_answers_done(server):
    async def main_two_frames():
        async with websockets.connect(_ws_url(server)) as ws:
            await ws.send(_request("fast", "Go", max_tokens=300, ignore_eos=True))
            await ws.send(json.dumps({"type": "cancel", "id": "fast"}))
            done = await _collect(ws, {"fast"})
            await ws.send(_request("fast", "Again", max_tokens=3))  # the id is free again
            again = await _collect(ws, {"fast"})
            return done, again

    done, again = asyncio.run(main_two_frames())
    assert done["fast"][-1]["type"] == "done" and done["fast"][-1]["finish_reasons"] == ["abort"]
    assert again["fast"][-1]["type"] == "done" and again["fast"][-1]["usage"]["completion_tokens"] == 3
    server.wait_idle()
