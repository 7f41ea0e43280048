"""The service on a real Redis: kill -9 mid-load, restart, and the ledger equals what clients were told."""

import asyncio
import time

import aiohttp
import requests

from tests.service.conftest import run_server, stories_settings, write_tenants_file
from tests.service.redis_fixture import own_redis_server  # noqa: F401

KEY = "sk-redis-test"


def _tenants_file(tmp_path):
    return write_tenants_file(tmp_path / "tenants.toml",  # the default "standard" plan: 0.50 / 0.05 / 1.50
                              {"acme": {"keys": [KEY], "plan": "standard", "requests_per_minute": 100000}})


def test_killing_redis_mid_load_loses_no_usage(stories_dir, tmp_path, own_redis_server):  # noqa: F811
    settings = stories_settings(stories_dir, server={"tenants_file": str(_tenants_file(tmp_path)),
                                                     "redis_url": own_redis_server.url})
    headers = {"Authorization": f"Bearer {KEY}"}
    with run_server(settings) as server:

        async def one(session, i):
            body = {"model": "stories260K", "prompt": f"Tale {i % 5}: a fox, a hen and a dog. " * 3,
                    "max_tokens": 5 + i % 7, "temperature": 0}
            async with session.post(server.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return (await response.json())["usage"]

        async def load():
            async with aiohttp.ClientSession(headers=headers) as session:
                first = await asyncio.gather(*(one(session, i) for i in range(20)))
                own_redis_server.kill()  # kill -9 mid-load: serving goes on, records wait in the journal
                during = await asyncio.gather(*(one(session, i) for i in range(20, 40)))
                async with session.get(server.url + "/v1/usage") as response:
                    assert response.status == 503 and response.headers["Retry-After"] == "5"
                own_redis_server.start()
                last = await asyncio.gather(*(one(session, i) for i in range(40, 50)))
                return first + during + last

        told = asyncio.run(load())
        deadline = time.monotonic() + 20
        while server.state.journal.num_pending and time.monotonic() < deadline:
            time.sleep(0.05)
        totals = requests.get(server.url + "/v1/usage", headers=headers, timeout=10).json()
    assert totals["pending_records"] == 0
    assert totals["requests"] == 50
    assert totals["prompt_tokens"] == sum(u["prompt_tokens"] for u in told)
    assert totals["cached_tokens"] == sum(u["prompt_tokens_details"]["cached_tokens"] for u in told)
    assert totals["completion_tokens"] == sum(u["completion_tokens"] for u in told)
    assert totals["cached_tokens"] > 0
