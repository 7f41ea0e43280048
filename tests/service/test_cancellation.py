"""Clients that leave mid-stream: their requests are aborted and every page comes back."""

import asyncio
import json
import time

import aiohttp

from tests.service.conftest import run_server, stories_settings


NUM_STREAMS, MAX_TOKENS = 40, 400


def test_dropped_sse_streams_free_every_page(stories_dir):
    with run_server(stories_settings(stories_dir, num_blocks=512, max_num_seqs=64)) as server:
        metrics = server.state.metrics

        def num_aborted() -> float:
            return metrics.requests.labels(finished_reason="abort")._value.get()

        async def one(session, i):
            body = {"model": "stories260K", "prompt": f"Story number {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": True, "temperature": 0.8, "seed": i}
            async with session.post(server.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                seen = 0
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        seen += 1
                    if seen == 3 + i % 5:
                        return seen  # leave mid-stream: the connection closes

        async def main():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(one(session, i) for i in range(NUM_STREAMS)))

        with server.counting_engine_tokens() as generated:
            assert all(n is not None for n in asyncio.run(main()))
            deadline = time.monotonic() + 30  # only a safety net: the wait ends when all 40 are counted
            while num_aborted() < NUM_STREAMS and time.monotonic() < deadline:
                time.sleep(0.02)
            stats = server.wait_idle(timeout=30)
        assert num_aborted() == NUM_STREAMS
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        # The streams were stopped, not run out: 40 x 400 tokens is far more than the engine made.
        assert generated.value < NUM_STREAMS * MAX_TOKENS // 4, generated.value
        assert metrics.generation_tokens._value.get() < NUM_STREAMS * MAX_TOKENS // 4
        server.state.engine.check_invariants()  # the engine thread is idle: safe to read


def test_requests_past_the_queue_get_429_with_retry_after(stories_dir):
    settings = stories_settings(stories_dir, max_num_seqs=1)
    settings.server.max_queued_requests = 1
    settings.server.admission_wait_s = 0.2  # past the places in flight: a short wait for one, then 429
    with run_server(settings) as server:

        async def main():
            async with aiohttp.ClientSession() as session:
                body = {"model": "stories260K", "prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
                held = [await session.post(server.url + "/v1/completions", json=body) for _ in range(2)]
                extra = await session.post(server.url + "/v1/completions", json=body)
                result = (extra.status, extra.headers.get("Retry-After"), json.loads(await extra.read()))
                for response in held:
                    response.close()
                return result

        status, retry_after, body = asyncio.run(main())
        assert status == 429 and retry_after == "1"
        assert body["error"]["type"] == "rate_limit_error"
        server.wait_idle()
