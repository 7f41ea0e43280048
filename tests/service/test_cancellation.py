"""Clients that leave mid-stream: their requests are aborted and every page comes back."""

import asyncio
import json

import aiohttp

from tests.service.conftest import run_server, stories_settings


def test_dropped_sse_streams_free_every_page(stories_dir):
    with run_server(stories_settings(stories_dir, num_blocks=512, max_num_seqs=64)) as server:

        async def one(session, i):
            body = {"model": "stories260K", "prompt": f"Story number {i}", "max_tokens": 400, "ignore_eos": True,
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
                return await asyncio.gather(*(one(session, i) for i in range(40)))

        assert all(n is not None for n in asyncio.run(main()))
        stats = server.wait_idle(timeout=3)  # 40 x 400 tokens would take far longer to run out
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
        assert server.state.metrics.requests.labels(finished_reason="abort")._value.get() == 40
        server.state.engine.check_invariants()  # the engine thread is idle: safe to read


def test_requests_past_the_queue_get_429_with_retry_after(stories_dir):
    settings = stories_settings(stories_dir, max_num_seqs=1)
    settings.server.max_queued_requests = 1
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
