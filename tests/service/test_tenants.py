"""Tenants over HTTP: keys, isolation of the prefix cache, usage and its cost, limits, pins."""

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import requests

from tests.service.conftest import run_server, stories_settings, write_tenants_file

KEYS = {"acme": "sk-acme-test", "globex": "sk-globex-test", "tiny": "sk-tiny-test"}
ADMIN_KEY = "sk-admin-test"
SYSTEM = "system: You are a storyteller who tells short happy stories about animals in a forest."


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    return write_tenants_file(
        tmp_path_factory.mktemp("tenants") / "tenants.toml",
        {"acme": {"keys": [KEYS["acme"]], "plan": "standard"},
         "globex": {"keys": [KEYS["globex"]], "plan": "standard"},
         "tiny": {"keys": [KEYS["tiny"]], "plan": "standard", "max_concurrent": 1, "requests_per_minute": 3}},
        plans={"standard": {"input_per_mtok": 0.50, "cached_input_per_mtok": 0.05, "output_per_mtok": 1.50}},
        admin_keys=[ADMIN_KEY],
        shared_prefixes=[{"name": "public-story", "text": SYSTEM}],
    )


@pytest.fixture(scope="module")
def server(stories_dir, tenants_file):
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants_file)})
    with run_server(settings) as running:
        yield running


def _client(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)


def _usage(server, key: str, **params) -> dict:
    response = requests.get(server.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"}, params=params,
                            timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def _settled_usage(server, key: str, **params) -> dict:
    deadline = time.monotonic() + 10
    while True:
        body = _usage(server, key, **params)
        if body["pending_records"] == 0 or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


def test_missing_and_wrong_keys_are_401_in_openai_shape(server):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic abc"}):
        response = requests.post(server.url + "/v1/completions", json={"model": "stories260K", "prompt": "x"},
                                 headers=headers, timeout=10)
        assert response.status_code == 401
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-nope", max_retries=0).models.list()


def test_prefix_cache_is_isolated_between_tenants(server):
    prompt = "Once upon a time there was a big red dog. " * 6  # many full pages
    acme, globex = _client(server, "acme"), _client(server, "globex")
    first = acme.completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0)
    other = globex.completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0)
    again = acme.completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # not acme's pages
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    assert other.choices[0].text == first.choices[0].text == again.choices[0].text
    salted = acme.completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0,
                                     extra_body={"cache_salt": "session-9"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0  # a client salt only narrows


def test_operator_shared_prefix_is_shared_and_only_it(server):
    acme, globex = _client(server, "acme"), _client(server, "globex")
    prompt = SYSTEM + " Tell me about the fox and the owl and the bear in the woods."
    acme.completions.create(model="stories260K", prompt=prompt, max_tokens=2, temperature=0)
    out = globex.completions.create(model="stories260K", prompt=prompt, max_tokens=2, temperature=0)
    num_system_tokens = len(server.state.engine.request_builder.tokenize(SYSTEM))
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached == (num_system_tokens // 16) * 16 and cached > 0  # the shared pages, not acme's suffix


def test_usage_bills_cached_input_at_its_own_rate_and_is_private(server):
    before, acme_before = _settled_usage(server, KEYS["globex"]), _settled_usage(server, KEYS["acme"])
    client = _client(server, "globex")
    told = []
    for _ in range(2):
        out = client.completions.create(model="stories260K", prompt="The cat sat on the mat. " * 5, max_tokens=7,
                                        temperature=0)
        told.append(out.usage)
    after = _settled_usage(server, KEYS["globex"])
    assert _settled_usage(server, KEYS["acme"]) == acme_before  # on globex's bill, and on no one else's
    prompt = sum(u.prompt_tokens for u in told)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in told)
    completion = sum(u.completion_tokens for u in told)
    assert after["requests"] - before["requests"] == 2
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt
    assert after["cached_tokens"] - before["cached_tokens"] == cached > 0
    assert after["completion_tokens"] - before["completion_tokens"] == completion
    from decimal import Decimal

    cost = (Decimal(prompt - cached) * Decimal("0.50") + Decimal(cached) * Decimal("0.05")
            + Decimal(completion) * Decimal("1.50")) / Decimal(10**6)
    assert Decimal(after["cost_usd"]) - Decimal(before["cost_usd"]) == cost
    assert after["tenant"] == "globex"
    denied = requests.get(server.url + "/v1/usage", params={"tenant": "acme"},
                          headers={"Authorization": f"Bearer {KEYS['globex']}"}, timeout=10)
    assert denied.status_code == 404
    assert _usage(server, ADMIN_KEY, tenant="globex")["requests"] == after["requests"]


def test_cancelled_stream_is_billed_for_what_it_got(server):
    before = _settled_usage(server, KEYS["acme"])

    async def main():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEYS['acme']}"}) as session:
            body = {"model": "stories260K", "prompt": "Hello there", "max_tokens": 300, "stream": True,
                    "ignore_eos": True}
            async with session.post(server.url + "/v1/completions", json=body) as response:
                chunks = 0
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        chunks += 1
                    if chunks == 5:
                        return

    asyncio.run(main())
    server.wait_idle()
    after = _settled_usage(server, KEYS["acme"])
    assert after["requests"] - before["requests"] == 1
    assert 5 <= after["completion_tokens"] - before["completion_tokens"] < 300


def test_tenant_limits_give_429_naming_the_limit(server):
    async def main():
        headers = {"Authorization": f"Bearer {KEYS['tiny']}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            body = {"model": "stories260K", "prompt": "Hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
            held = await session.post(server.url + "/v1/completions", json=body)
            second = await session.post(server.url + "/v1/completions", json=body)
            concurrent = (second.status, second.headers.get("Retry-After"), json.loads(await second.read()))
            held.close()
            return concurrent

    status, retry_after, body = asyncio.run(main())
    assert status == 429 and int(retry_after) >= 1
    assert "max_concurrent" in body["error"]["message"] and body["error"]["type"] == "rate_limit_error"
    server.wait_idle()
    statuses = []
    for _ in range(3):
        response = requests.post(server.url + "/v1/completions", json={"model": "stories260K", "prompt": "x", "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {KEYS['tiny']}"}, timeout=10)
        statuses.append((response.status_code, response.json().get("error", {}).get("message", "")))
    assert statuses[-1][0] == 429 and "requests_per_minute" in statuses[-1][1]


def test_prefix_index_lookup_finds_this_replica(server):
    prompt = "A long walk in the park with a little dog and a big cat. " * 4
    _client(server, "acme").completions.create(model="stories260K", prompt=prompt, max_tokens=1, temperature=0)
    time.sleep(0.4)  # the publisher batches every 0.1 s
    response = requests.get(server.url + "/v1/prefix-index/lookup", params={"tenant": "acme", "prompt": prompt},
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    body = response.json()
    assert response.status_code == 200
    assert body["replicas"][server.state.replica_id] == body["num_full_blocks"] > 0
    other = requests.get(server.url + "/v1/prefix-index/lookup", params={"tenant": "globex", "prompt": prompt},
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).json()
    assert other["replicas"].get(server.state.replica_id, 0) == 0
    forbidden = requests.get(server.url + "/v1/prefix-index/lookup", params={"tenant": "acme", "prompt": prompt},
                             headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=10)
    assert forbidden.status_code == 404


def test_pinned_prefix_survives_a_restart(stories_dir, tenants_file):
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants_file)}, pinned_block_budget=8)
    headers = {"Authorization": f"Bearer {KEYS['acme']}"}
    pin_text = "system: Always answer with a story about a brave little mouse and her friends."
    with run_server(settings) as server:
        response = requests.post(server.url + "/v1/pinned-prefixes", json={"id": "mouse", "text": pin_text},
                                 headers=headers, timeout=10)
        assert response.status_code == 201
    with run_server(settings) as server:  # same data folder: the registry is read back
        deadline = time.monotonic() + 10
        while server.state.bridge.stats.get("num_pinned_blocks", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        num_pin_tokens = len(server.state.engine.request_builder.tokenize(pin_text))
        assert server.state.bridge.stats["num_pinned_blocks"] == num_pin_tokens // 16
        listed = requests.get(server.url + "/v1/pinned-prefixes", headers=headers, timeout=10).json()["data"]
        assert [p["id"] for p in listed] == ["mouse"]
        out = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["acme"], max_retries=0).completions.create(
            model="stories260K", prompt=pin_text + " Go!", max_tokens=2, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens >= 16
        deleted = requests.delete(server.url + "/v1/pinned-prefixes/mouse", headers=headers, timeout=10)
        assert deleted.status_code == 200
        server.wait_idle()
        assert server.state.bridge.stats["num_pinned_blocks"] == 0


def test_no_tenant_created_prefix_joins_the_operators_shared_scope(stories_dir, tenants_file):
    """The shared scope holds the operator's listed prefixes and nothing a tenant makes: not a tenant's pin,
    not a prompt_cache_key the operator did not list, not the part of a prompt past the listed prefix."""
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants_file)},
                                pinned_block_budget=48)  # 16 pages for each of the three tenants' pins
    pin_text = "system: You are the secret planner of the acme picnic by the lake with the red boats."
    extended = SYSTEM + " Acme's own rules: the picnic is on the big hill by the old mill, bring the kites."
    with run_server(settings) as server:
        acme, globex = _client(server, "acme"), _client(server, "globex")

        def cached(client, prompt, **extra) -> int:
            out = client.completions.create(model="stories260K", prompt=prompt, max_tokens=1, temperature=0,
                                            extra_body=extra or None)
            return out.usage.prompt_tokens_details.cached_tokens

        pinned = requests.post(server.url + "/v1/pinned-prefixes", json={"id": "picnic", "text": extended},
                               headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=10)
        assert pinned.status_code == 201
        requests.post(server.url + "/v1/pinned-prefixes", json={"id": "planner", "text": pin_text},
                      headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=10).raise_for_status()
        num_system_blocks = len(server.state.engine.request_builder.tokenize(SYSTEM)) // 16
        assert cached(acme, pin_text + " Go!") >= 16  # acme's pin is acme's
        assert cached(globex, pin_text + " Go!") == 0  # a tenant's pin is not shared
        # a pin that begins with the operator's prefix: only the operator's whole pages are shared
        assert cached(acme, extended + " Go!") > num_system_blocks * 16
        assert cached(globex, extended + " Go!") == num_system_blocks * 16
        # prompt_cache_key only names the operator's prefixes: any other key (or a prompt that does not begin
        # with the named prefix) shares nothing
        private = "The acme secret: the picnic basket holds three cakes and a map of the woods. " * 2
        assert cached(acme, private, prompt_cache_key="picnic") == 0
        assert cached(acme, private, prompt_cache_key="picnic") > 0
        assert cached(globex, private, prompt_cache_key="picnic") == 0
        other = "The acme plan B: if it rains, the picnic moves to the barn behind the blue house. " * 2
        assert cached(acme, other, prompt_cache_key="public-story") == 0
        assert cached(globex, other, prompt_cache_key="public-story") == 0  # the operator's key, not its prefix
