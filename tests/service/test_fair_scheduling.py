"""Fair scheduling through a real server: plan weights reach the engine, `priority` is a field, the counters show."""

import openai
import pytest
import requests

from tests.service.conftest import run_server, stories_settings, write_tenants_file

KEYS = {"light": "sk-light-test", "heavy": "sk-heavy-test"}
ADMIN_KEY = "sk-admin-fair"


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    tenants_file = write_tenants_file(
        tmp_path_factory.mktemp("fair") / "tenants.toml",
        {"light": {"keys": [KEYS["light"]], "plan": "basic"}, "heavy": {"keys": [KEYS["heavy"]], "plan": "gold"}},
        plans={"basic": {"input_per_mtok": 0.5, "output_per_mtok": 1.5},
               "gold": {"input_per_mtok": 0.5, "output_per_mtok": 1.5, "weight": 3}},
        admin_keys=[ADMIN_KEY])
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants_file)}, scheduling="fair")
    with run_server(settings) as running:
        yield running


def _metric(text: str, name: str, tenant: str) -> float:
    prefix = f'{name}{{tenant="{tenant}"}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert lines, f"{prefix!r} not in /metrics"
    return float(lines[0].removeprefix(prefix))


def test_tenants_are_served_and_counted_by_their_plan_weight(server):
    for tenant in ("light", "heavy"):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0)
        reply = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=8,
                                          temperature=0, extra_body={"priority": -2, "ignore_eos": True})
        assert reply.usage.completion_tokens == 8
    server.wait_idle()
    text = requests.get(server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10).text
    for tenant in ("light", "heavy"):
        assert _metric(text, "pagedserve_tenant_served_output_tokens_total", tenant) == 8
        assert _metric(text, "pagedserve_tenant_requests_waiting", tenant) == 0
    # the same service, weighted 1 and 3: the heavy plan's counter grew a third as much
    light = _metric(text, "pagedserve_tenant_virtual_tokens", "light")
    heavy = _metric(text, "pagedserve_tenant_virtual_tokens", "heavy")
    prompt = _metric(text, "pagedserve_tenant_served_prompt_tokens_total", "heavy")
    assert heavy == pytest.approx((prompt + 2 * 8) / 3) and light > heavy


def test_priority_must_be_an_integer(server):
    response = requests.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEYS['light']}"},
                             json={"model": "stories260K", "prompt": "Hi", "max_tokens": 2, "priority": "high"},
                             timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


def test_a_full_server_lets_a_tenant_below_its_share_in_and_makes_the_flooder_wait_then_429(stories_dir, tmp_path):
    """Two places in flight (one seat, one queued), both the heavy tenant's long streams. The light tenant is
    below its share: it is let in at once and, under fair scheduling, streams before the flood ends. The heavy
    tenant's third request waits for a place (admission_wait_s), then gets a 429."""
    import asyncio
    import json
    import time

    import aiohttp

    tenants_file = write_tenants_file(tmp_path / "tenants.toml", {"light": {"keys": [KEYS["light"]], "plan": "basic"},
                                                                  "heavy": {"keys": [KEYS["heavy"]], "plan": "basic"}},
                                      plans={"basic": {"input_per_mtok": 0.5, "output_per_mtok": 1.5}})
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants_file), "max_queued_requests": 1,
                                                     "admission_wait_s": 0.5}, max_num_seqs=1, scheduling="fair")
    with run_server(settings) as server:
        async def main():
            body = {"model": "stories260K", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as session:
                def post(tenant: str, **extra):
                    return session.post(server.url + "/v1/completions", json={**body, **extra},
                                        headers={"Authorization": f"Bearer {KEYS[tenant]}"})

                flood = [await post("heavy") for _ in range(2)]
                await flood[0].content.readline()  # the first one streams
                started = time.monotonic()
                extra = await post("heavy")
                waited = time.monotonic() - started
                refused = (extra.status, json.loads(await extra.read()))
                light = await post("light", max_tokens=4)
                text = (await light.read()).decode()
                flood_running = server.call(heavy_in_flight)  # the engine's own count, not what the client read
                for response in flood:
                    response.close()
                return refused, waited, light.status, text, flood_running

        async def heavy_in_flight() -> int:
            return server.state.bridge.inflight_sequences_by_tenant()["heavy"]

        (status, body), waited, light_status, light_text, flood_running = asyncio.run(main())
        assert status == 429 and body["error"]["code"] == "too_many_requests" and waited >= 0.5
        assert light_status == 200 and light_text.rstrip().endswith("data: [DONE]")
        # the light tenant finished while the flood still ran: the second flood request, queued before light
        # came, was still in flight (under fcfs it runs its 400 tokens first, and light ends after the flood)
        assert flood_running >= 1
        server.wait_idle()


def _light_tenants_first_tokens(stories_dir, tmp_path, policy: str) -> list[dict]:
    """Heavy sends 24 prompts of 400 tokens at once (8 seats, computed 32 tokens a step: ~300 steps of prompt
    chunks) while light sends three short requests 20 ms apart; light's request traces
    (server.trace_requests), captured from the server's log."""
    import concurrent.futures
    import random
    import time

    import structlog

    tenants_file = write_tenants_file(tmp_path / f"tenants-{policy}.toml",
                                      {"light": {"keys": [KEYS["light"]], "plan": "basic"},
                                       "heavy": {"keys": [KEYS["heavy"]], "plan": "basic"}},
                                      plans={"basic": {"input_per_mtok": 0.5, "output_per_mtok": 1.5}})
    settings = stories_settings(stories_dir, server={"tenants_file": str(tenants_file), "trace_requests": True},
                                scheduling=policy, max_num_seqs=8, max_num_batched_tokens=32)
    rng = random.Random(5)

    def complete(tenant: str, prompt: list[int], max_tokens: int) -> requests.Response:
        body = {"model": "stories260K", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}
        return requests.post(server.url + "/v1/completions", json=body, timeout=120,
                             headers={"Authorization": f"Bearer {KEYS[tenant]}"})

    with structlog.testing.capture_logs() as logs, run_server(settings) as server:
        with concurrent.futures.ThreadPoolExecutor(27) as pool:
            flood = [pool.submit(complete, "heavy", [1] + [rng.randrange(3, 500) for _ in range(399)], 2)
                     for _ in range(24)]
            time.sleep(0.3)  # the flood is in the engine
            light = []
            for _ in range(3):  # a few steps apart, all while the flood lasts
                light.append(pool.submit(complete, "light", [1] + [rng.randrange(3, 500) for _ in range(7)], 2))
                time.sleep(0.02)
            for done in light + flood:
                assert done.result().status_code == 200
        server.wait_idle(60)
    return [line for line in logs if line["event"] == "request trace" and line["tenant"] == "light"]


def test_a_light_tenants_first_token_under_fair_takes_no_more_steps_than_under_fcfs_and_its_step_is_short(
        stories_dir, tmp_path):
    """Through a real server, counted in engine steps (so it holds on any machine): under a flood, each of the
    light tenant's requests gets its first token within fcfs's step count plus one, and the step that computes
    its prompt carries the decodes and that prompt only, none of the flood's chunks (before, it carried a
    full budget of them)."""
    traced = {policy: _light_tenants_first_tokens(stories_dir, tmp_path, policy) for policy in ("fcfs", "fair")}

    def steps_to_first_token(trace: dict) -> int:  # the steps after it was queued, up to the one that sampled it
        engine = trace["engine"]
        return engine["first_token"]["index"] - engine["first_scheduled"]["index"] + 1 + engine["num_steps_waited"]

    assert len(traced["fcfs"]) == len(traced["fair"]) == 3
    fcfs, fair = ([steps_to_first_token(t) for t in traced[p]] for p in ("fcfs", "fair"))
    assert max(fair) <= min(fcfs) + 1, (fair, fcfs)
    assert min(fcfs) > 10  # the flood was there: under fcfs light waited behind its prompts
    for trace in traced["fair"]:
        step = trace["engine"]["first_token"]
        # a seat from the flood within two steps: light rises to heavy's counter on arrival, and takes a seat once
        # heavy's counter is past it (runtime/fairness.py: a tie takes nobody's seat), after one more step
        assert trace["engine"]["num_steps_waited"] <= 2
        assert step == trace["engine"]["first_scheduled"]  # an 8-token prompt: one step
        assert step["num_waiting"] > 0  # the flood was still waiting for seats then
        assert step["num_tokens"] - step["num_decodes"] == 8, step  # light's 8 prompt tokens, no flood chunk
