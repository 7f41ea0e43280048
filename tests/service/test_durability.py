"""kill -9 of the server mid-load: every answer a client received whole is billed after the restart.

A real `pagedserve serve` process takes a steady mixed load (12 clients: chat and completions,
half of them streaming), is killed with SIGKILL, and is started again on the same data folder.
Every request whose client got its whole answer (the JSON body, or an SSE stream up to
`[DONE]`) must then be in the ledger with the tokens the client was told, and in /v1/usage.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import aiohttp
import redis
import requests

from tests.processes import Process
from tests.service.redis_fixture import own_redis_server  # noqa: F401

NUM_CLIENTS = 12
KILL_AFTER = 30  # answers received before the kill


def start_server(model_dir: Path, data_dir: Path, redis_url: str | None = None) -> Process:
    """`python -m service.cli serve` on a port of its own choosing, its log in the data folder."""
    args = ["serve", "--model", str(model_dir), "--port", "0", "--data-dir", str(data_dir),
            "--num-blocks", "256", "--max-num-seqs", "16"]
    if redis_url:
        args += ["--redis-url", redis_url]
    return Process("server", args, 0, data_dir, {})


def _body(client: int, turn: int) -> tuple[str, dict]:
    stream = client % 2 == 0
    common = {"model": "stories260K", "max_tokens": 8 + (client * 7 + turn) % 24, "temperature": 0.7,
              "seed": client * 1000 + turn, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if client % 4 < 2:
        return "/v1/completions", {**common, "prompt": f"Story {client}.{turn}: Once upon a time"}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tale {client}.{turn}"}]}


async def _one(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict | None:
    """The answer's id and usage if the whole answer arrived; None if it was cut off."""
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            return None
        if not body["stream"]:
            answer = json.loads(await response.read())
            return {"id": answer["id"], **answer["usage"]}
        answer_id, usage = None, None
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):].strip()
            if data == b"[DONE]":
                return {"id": answer_id, **usage} if usage is not None else None
            event = json.loads(data)
            if "error" in event:
                return None
            answer_id = event["id"]
            usage = event.get("usage") or usage
        return None  # the connection ended before [DONE]


async def _load_until_killed(server: Process) -> list[dict]:
    received: list[dict] = []
    killed = asyncio.Event()

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        turn = 0
        while not killed.is_set():
            path, body = _body(index, turn)
            turn += 1
            try:
                answer = await _one(session, server.url, path, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
                return  # the server is gone
            if answer is not None:
                received.append(answer)

    async def killer() -> None:
        while len(received) < KILL_AFTER:
            await asyncio.sleep(0.005)
        server.kill()  # in the middle of ~12 requests in flight
        killed.set()

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(killer(), *(client(session, i) for i in range(NUM_CLIENTS)))
    return received


def _usage_after_replay(server: Process) -> dict:
    deadline = time.monotonic() + 30
    while True:
        totals = requests.get(server.url + "/v1/usage", timeout=10).json()
        if totals["pending_records"] == 0 or time.monotonic() > deadline:
            return totals
        time.sleep(0.05)


def _check_totals(totals: dict, received: list[dict]) -> None:
    assert totals["pending_records"] == 0
    assert totals["requests"] >= len(received)  # requests cut off by the kill may be billed too
    assert totals["completion_tokens"] >= sum(a["completion_tokens"] for a in received)
    assert totals["prompt_tokens"] >= sum(a["prompt_tokens"] for a in received)


def test_kill_9_mid_load_loses_no_answered_request_sqlite(stories_dir, tmp_path):
    server = start_server(stories_dir, tmp_path)
    try:
        server.wait_ready()
        received = asyncio.run(_load_until_killed(server))
    finally:
        server.kill()
    assert len(received) >= KILL_AFTER and len({a["id"] for a in received}) == len(received)
    restarted = start_server(stories_dir, tmp_path)
    try:
        restarted.wait_ready()
        totals = _usage_after_replay(restarted)
        with sqlite3.connect(f"file:{tmp_path / 'ledger.sqlite3'}?mode=ro", uri=True) as db:
            rows = {row[0]: row[1:] for row in db.execute(
                "SELECT request_id, prompt_tokens, cached_tokens, completion_tokens FROM usage")}
    finally:
        restarted.stop()
    missing = [a["id"] for a in received if a["id"] not in rows]
    assert missing == []
    for answer in received:
        assert rows[answer["id"]] == (answer["prompt_tokens"], answer["prompt_tokens_details"]["cached_tokens"],
                                      answer["completion_tokens"]), answer["id"]
    _check_totals(totals, received)


def test_kill_9_mid_load_loses_no_answered_request_redis(stories_dir, tmp_path, own_redis_server):  # noqa: F811
    server = start_server(stories_dir, tmp_path, own_redis_server.url)
    try:
        server.wait_ready()
        received = asyncio.run(_load_until_killed(server))
    finally:
        server.kill()
    assert len(received) >= KILL_AFTER
    restarted = start_server(stories_dir, tmp_path, own_redis_server.url)
    try:
        restarted.wait_ready()
        totals = _usage_after_replay(restarted)
    finally:
        restarted.stop()
    client = redis.Redis.from_url(own_redis_server.url)
    try:
        seen = client.mget([f"pagedserve:usage-seen:{a['id']}" for a in received])
    finally:
        client.close()
    assert [a["id"] for a, flag in zip(received, seen) if flag is None] == []
    _check_totals(totals, received)


def test_usage_counts_a_request_as_soon_as_its_answer_arrived(stories_dir):
    """docs/tenants.md: a request is in /v1/usage once its final message has been sent, even with a slow ledger."""
    from tests.service.conftest import run_server, stories_settings

    with run_server(stories_settings(stories_dir)) as server:
        ledger = server.state.ledger
        record_many = ledger.record_many

        async def slow_record_many(items):  # each batch reaches the ledger 0.3 s after it is on disk
            await asyncio.sleep(0.3)
            return await record_many(items)

        ledger.record_many = slow_record_many
        for stream in (False, True):
            before = requests.get(server.url + "/v1/usage", timeout=10).json()
            body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0,
                    "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
            response = requests.post(server.url + "/v1/completions", json=body, timeout=30, stream=stream)
            if stream:
                events = [line[len(b"data: "):] for line in response.iter_lines() if line.startswith(b"data: ")]
                assert events[-1] == b"[DONE]"
                usage = json.loads(events[-2])["usage"]
            else:
                usage = response.json()["usage"]
            after = requests.get(server.url + "/v1/usage", timeout=10).json()
            assert after["requests"] - before["requests"] == 1, stream
            assert after["completion_tokens"] - before["completion_tokens"] == usage["completion_tokens"] == 7
            assert after["prompt_tokens"] - before["prompt_tokens"] == usage["prompt_tokens"]


def test_an_answer_whose_usage_cannot_be_written_does_not_complete(stories_dir):
    """JSON: a 503 instead of the body; SSE: an error event and no [DONE]; nothing hangs."""
    from tests.service.conftest import run_server, stories_settings

    with run_server(stories_settings(stories_dir, server={"usage_write_timeout_s": 0.5})) as server:
        def broken_write(data: bytes) -> None:
            raise OSError(28, "No space left on device")

        server.state.journal._file.write = broken_write
        body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        whole = requests.post(server.url + "/v1/completions", json=body, timeout=30)
        streamed = requests.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
        events = [line for line in streamed.content.split(b"\n\n") if line]
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "usage_not_recorded"
    assert whole.headers["Retry-After"] == "5"
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "usage_not_recorded"
    assert b"data: [DONE]" not in events
