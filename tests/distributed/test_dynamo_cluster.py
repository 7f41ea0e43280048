"""pagedserve workers behind NVIDIA Dynamo's KV-aware router: real processes on 127.0.0.1.

redis-server + three `pagedserve worker`s (stories260K, 64 pages each) + one front door
(`pagedserve serve --router dynamo`, tenants, Redis ledger). The tests run in file order on
one cluster; the last one kills a worker and starts a new one.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import jsonschema
import msgspec
import pytest
import requests

from tests.distributed.cluster import start_front_door, start_worker, wait_until, worker_stats
from tests.service.conftest import write_tenants_file
from tests.service.redis_fixture import start_server
from tests.structured.schema_battery import SCHEMAS

import dynamo._core  # noqa: E402,F401  ai-dynamo-runtime, a dev dependency (`make test` installs it): missing fails

ACME, GLOBEX, ADMIN = "sk-acme-test", "sk-globex-test", "sk-admin-test"
NUM_BLOCKS = 64
SYSTEM = ("You are the storyteller of a small town. Every story has a dog named Max, a cat named Lily, "
          "a red ball and a big tree by the river. The stories are short, kind and happy, and they always end "
          "with the friends going home for dinner when the sun goes down behind the hills.")

SHARED = ("House rules for every assistant of this deployment: answer in plain words, keep to the story, "
          "never make up facts about real people, and end each answer with a short question.\n")


def _headers(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, stories_dir):
    root = tmp_path_factory.mktemp("dynamo-cluster")
    redis_server = start_server(root / "redis")
    tenants = write_tenants_file(root / "tenants.toml", {"acme": {"keys": [ACME], "plan": "standard"},
                                                         "globex": {"keys": [GLOBEX], "plan": "standard"}},
                                 admin_keys=[ADMIN], shared_prefixes=[{"name": "house-rules", "text": SHARED}])
    env = {"PAGEDSERVE_SERVER_CACHE_SALT_SECRET": "cluster-test-secret"}
    discovery = root / "discovery"
    flags = ("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "8")
    # worker-0 also publishes vLLM-format events, on Unix sockets of its own (no port to race for; a short
    # folder, as a socket path has at most 107 bytes)
    sockets = Path(tempfile.mkdtemp(prefix="kv-events-"))
    replay = f"ipc://{sockets}/replay.sock"
    events = ("--kv-events-endpoint", f"ipc://{sockets}/events.sock", "--kv-events-replay-endpoint", replay)
    workers = [start_worker(f"worker-{i}", stories_dir, discovery, root, *flags, *(events if i == 0 else ()), env=env)
               for i in range(3)]
    front = None
    extra = []
    try:
        for worker in workers:
            worker.wait_ready()
        front = start_front_door(stories_dir, discovery, root / "data", root, "--tenants", str(tenants),
                                 "--redis-url", redis_server.url, env=env)
        front.wait_ready(check=lambda body: body["workers"] == 3)
        second = start_front_door(stories_dir, discovery, root / "data-2", root, "--tenants", str(tenants),
                                  "--redis-url", redis_server.url, env=env, name="front-door-2")
        extra.append(second)
        second.wait_ready(check=lambda body: body["workers"] == 3)
        yield {"front": front, "second": second, "workers": workers, "redis": redis_server, "root": root, "discovery": discovery,
               "flags": flags, "env": env, "model": stories_dir, "replay": replay}
    finally:
        for process in ([front] if front else []) + extra + workers:
            process.stop()
        redis_server.stop()
        redis_server.remove_socket_dir()
        shutil.rmtree(sockets, ignore_errors=True)


def _chat(front, key: str, user: str, max_tokens: int = 4, system: str = SYSTEM, **extra) -> dict:
    body = {"model": "stories260K", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **extra}
    response = requests.post(front.url + "/v1/chat/completions", json=body, headers=_headers(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _complete(front, key: str, prompt: str, max_tokens: int = 4) -> dict:
    body = {"model": "stories260K", "max_tokens": max_tokens, "temperature": 0, "prompt": prompt}
    response = requests.post(front.url + "/v1/completions", json=body, headers=_headers(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def _all_stats(cluster) -> list[dict]:
    return [worker_stats(w) for w in cluster["workers"] if w.process.poll() is None]


def _idle(cluster) -> list[dict] | None:
    stats = _all_stats(cluster)
    ok = all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_used_blocks"] == s["num_pinned_blocks"]
             for s in stats)
    return stats if ok else None


def _lookup(front, tenant: str, text: str) -> dict[str, int]:
    response = requests.get(front.url + "/v1/prefix-index/lookup", params={"tenant": tenant, "prompt": text},
                            headers=_headers(ADMIN), timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["replicas"]


def _usage(front, key: str) -> dict:
    deadline = time.monotonic() + 20
    while True:
        totals = requests.get(front.url + "/v1/usage", headers=_headers(key), timeout=10).json()
        if totals["pending_records"] == 0 or time.monotonic() > deadline:
            return totals
        time.sleep(0.05)


def _stream_lines(front, key: str, body: dict):
    """(response, iterator over SSE data payloads) of a streamed completion."""
    response = requests.post(front.url + "/v1/completions", json={**body, "stream": True}, headers=_headers(key),
                             stream=True, timeout=60)
    assert response.status_code == 200, response.text
    lines = (line[len(b"data: "):] for line in response.iter_lines() if line.startswith(b"data: "))
    return response, lines


def test_a_tenants_turns_go_to_the_worker_that_holds_its_system_prompt(cluster):
    front = cluster["front"]
    hits_before = [s["prefix_cache_hits"] for s in _all_stats(cluster)]
    first = _chat(front, ACME, "Tell me about the ball.")
    assert _cached(first) == 0
    turns = [_chat(front, ACME, f"Turn {i}: what did Max do next?") for i in range(5)]
    assert all(_cached(turn) >= 64 for turn in turns), [_cached(t) for t in turns]
    gained = [s["prefix_cache_hits"] - before for s, before in zip(_all_stats(cluster), hits_before)]
    assert sorted(g > 0 for g in gained) == [False, False, True], gained  # one worker served every hit


def test_distinct_prompts_spread_over_every_worker(cluster):
    front = cluster["front"]
    queries_before = [s["prefix_cache_queries"] for s in _all_stats(cluster)]
    answers: list[dict] = []

    def one(i: int) -> None:
        answers.append(_chat(front, ACME, f"Story number {i}", max_tokens=24,
                             system=f"Story {i} of the day: a tale of a brave little fox number {i} and a bird."))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == 12
    gained = [s["prefix_cache_queries"] - before for s, before in zip(_all_stats(cluster), queries_before)]
    assert all(g > 0 for g in gained), gained


def test_another_tenant_never_reads_the_first_tenants_pages(cluster):
    front = cluster["front"]
    prompt = SYSTEM + " Today:"
    _complete(front, ACME, prompt)
    assert _cached(_complete(front, ACME, prompt)) > 0
    acme_view = _lookup(front, "acme", SYSTEM)
    assert sorted(acme_view.values())[-1] > 0 and sorted(acme_view.values())[:2] == [0, 0], acme_view
    globex_view = _lookup(front, "globex", SYSTEM)
    assert len(globex_view) == 3 and all(blocks == 0 for blocks in globex_view.values())  # salts kept apart
    assert _cached(_complete(front, GLOBEX, prompt)) == 0
    assert _cached(_complete(front, GLOBEX, prompt)) > 0  # globex now has its own copy, under its own salt


def test_an_operator_shared_prefix_is_routed_to_its_pages_for_every_tenant(cluster):
    front = cluster["front"]
    assert _cached(_complete(front, ACME, SHARED + "Acme asks about boats.")) == 0
    holders = _lookup(front, "globex", SHARED + "Globex asks about fish.")  # routed unsalted: the shared blocks count
    assert sorted(holders.values())[-1] >= 3 and sorted(holders.values())[:2] == [0, 0], holders
    assert _cached(_complete(front, GLOBEX, SHARED + "Globex asks about fish.")) >= 48  # acme's shared pages


def test_structured_outputs_and_tool_calls_cross_to_the_workers(cluster):
    front = cluster["front"]
    schema = SCHEMAS["several_fields"]
    answer = _chat(front, ACME, "Describe Max.", max_tokens=200, temperature=1.0, n=3, seed=4, logit_bias={"5": -100},
                   response_format={"type": "json_schema", "json_schema": {"name": "dog", "schema": schema}})
    for choice in answer["choices"]:  # each worker compiles the schema from the call's SamplingParams
        assert choice["finish_reason"] == "stop", answer
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    tool = {"type": "function", "function": {"name": "fetch", "parameters": SCHEMAS["one_integer_range"]}}
    called = _chat(front, GLOBEX, "Fetch it.", max_tokens=100, tools=[tool], tool_choice="required",
                   parallel_tool_calls=False)
    [call] = called["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "fetch" and called["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["one_integer_range"])
    body = {"model": "stories260K", "messages": [{"role": "user", "content": "x"}], "guided_regex": "a(b"}
    bad = requests.post(front.url + "/v1/chat/completions", json=body, headers=_headers(ACME), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"  # refused before it leaves


def test_responses_and_messages_work_through_the_front_doors_which_share_stored_responses(cluster):
    front, second = cluster["front"], cluster["second"]
    body = {"model": "stories260K", "instructions": SYSTEM, "input": "Tell me about Max.", "max_output_tokens": 8,
            "temperature": 0}
    first = requests.post(front.url + "/v1/responses", json=body, headers=_headers(ACME), timeout=60).json()
    assert first["status"] == "incomplete" and first["usage"]["output_tokens"] == 8, first
    text = first["output"][0]["content"][0]["text"]
    assert text == _chat(front, ACME, "Tell me about Max.", max_tokens=8)["choices"][0]["message"]["content"]
    # the store is Redis: the other front door reads and continues it, for its tenant only
    fetched = requests.get(f"{second.url}/v1/responses/{first['id']}", headers=_headers(ACME), timeout=10)
    assert fetched.status_code == 200 and fetched.json() == first
    assert requests.get(f"{second.url}/v1/responses/{first['id']}", headers=_headers(GLOBEX), timeout=10).status_code == 404
    follow = {"model": "stories260K", "instructions": SYSTEM, "previous_response_id": first["id"], "input": "And Lily?",
              "max_output_tokens": 6, "temperature": 0}
    turn = requests.post(second.url + "/v1/responses", json=follow, headers=_headers(ACME), timeout=60).json()
    whole = _chat(second, ACME, "", max_tokens=6, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about Max."},
        {"role": "assistant", "content": text}, {"role": "user", "content": "And Lily?"}])
    assert turn["output"][0]["content"][0]["text"] == whole["choices"][0]["message"]["content"]
    assert turn["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] // 16 * 16
    message = requests.post(front.url + "/v1/messages", headers={"x-api-key": ACME}, timeout=60, json={
        "model": "stories260K", "max_tokens": 8, "temperature": 0, "system": SYSTEM,
        "messages": [{"role": "user", "content": "Tell me about Max."}]}).json()
    assert message["content"][0]["text"] == text and message["stop_reason"] == "max_tokens"
    usage = message["usage"]
    assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] + usage["cache_read_input_tokens"] + \
        usage["cache_creation_input_tokens"] == first["usage"]["input_tokens"]


def test_a_second_front_door_serves_the_websocket_and_shares_the_ledger(cluster):
    import websockets
    front, second = cluster["front"], cluster["second"]
    before = _usage(front, ACME)

    async def one_request() -> dict:
        url = second.url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(url, additional_headers=_headers(ACME)) as ws:
            body = {"model": "stories260K", "max_tokens": 6, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Over the socket"}]}
            await ws.send(json.dumps({"type": "request", "id": "w1", "body": body}))
            while True:
                message = json.loads(await ws.recv())
                if message["type"] in ("done", "error"):
                    return message

    import asyncio

    done = asyncio.run(one_request())
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 6, done
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # routed to acme's worker
    after = wait_until(lambda: (u := _usage(front, ACME))["requests"] == before["requests"] + 1 and u,
                       what="the other front door's usage in the shared ledger")
    assert after["completion_tokens"] - before["completion_tokens"] == 6


def test_a_pin_is_placed_on_every_worker(cluster):
    front = cluster["front"]
    text = "system: The pinned preamble of acme. " * 6
    response = requests.post(front.url + "/v1/pinned-prefixes", json={"id": "preamble", "text": text},
                             headers=_headers(ACME), timeout=30)
    assert response.status_code in (200, 201), response.text
    try:
        assert all(s["num_pinned_blocks"] > 0 for s in _all_stats(cluster))
        view = _lookup(front, "acme", text)
        assert len(view) == 3 and all(blocks > 0 for blocks in view.values()), view
    finally:
        _unpin(front, "preamble")


def _gauges(url: str) -> dict[str, str]:
    """The vllm:* lines of a /metrics page (read with the admin key): name{labels} -> value."""
    text = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).text
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("vllm:"))


def _pin(front, pin_id: str, text: str) -> dict:
    response = requests.post(front.url + "/v1/pinned-prefixes", json={"id": pin_id, "text": text},
                             headers=_headers(ACME), timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def _unpin(front, pin_id: str) -> None:
    requests.delete(front.url + f"/v1/pinned-prefixes/{pin_id}", headers=_headers(ACME), timeout=30)


def test_workers_and_the_front_door_export_the_gauges_kubernetes_routers_read(cluster):
    _pin(cluster["front"], "gauges", "system: Pages held while the gauges are read. " * 3)  # usage above 0
    try:
        wait_until(lambda: _idle(cluster), what="every worker idle")
        pinned = _all_stats(cluster)[0]["num_pinned_blocks"]
        worker = _gauges(cluster["workers"][0].url)
    finally:
        _unpin(cluster["front"], "gauges")
    usage = float(next(v for k, v in worker.items() if k.startswith("vllm:kv_cache_usage_perc{")))
    assert pinned > 0 and usage == pytest.approx(pinned / NUM_BLOCKS)
    assert any(k.startswith("vllm:num_requests_running{") for k in worker)
    assert any(k.startswith("vllm:num_requests_waiting{") for k in worker)
    assert any(k.startswith("vllm:cache_config_info{") and 'num_gpu_blocks="64"' in k for k in worker)
    front = _gauges(cluster["front"].url)  # the front door sums its workers
    assert any(k.startswith("vllm:cache_config_info{") and f'num_gpu_blocks="{3 * NUM_BLOCKS}"' in k for k in front)


def test_a_client_that_disconnects_frees_the_workers_pages(cluster):
    front = cluster["front"]
    response, lines = _stream_lines(front, ACME, {"model": "stories260K", "prompt": "Once upon a time",
                                                  "max_tokens": 480, "ignore_eos": True})
    first = json.loads(next(lines))
    next(lines)
    wait_until(lambda: any(s["num_running"] > 0 for s in _all_stats(cluster)), what="the request running")
    response.close()  # the client goes away mid-stream
    stats = wait_until(lambda: _idle(cluster), what="every worker idle with its pages free")
    assert sum(s["num_free_blocks"] for s in stats) == sum(s["num_blocks"] - s["num_pinned_blocks"] for s in stats)
    stopped = wait_until(lambda: [w for w in cluster["workers"] if first["id"] in w.tail(200_000)
                                  and "request stopped by its caller" in w.tail(200_000)],
                         what="the worker's log of the stop")
    assert len(stopped) == 1


def test_eviction_reaches_the_router(cluster):
    front = cluster["front"]
    system = "Evict me: the old miller and his three sons went to the market on a rainy day. " * 3
    _complete(front, ACME, system)
    assert max(_lookup(front, "acme", system).values()) > 0
    for round_ in range(20):  # distinct long prompts until every worker's pool has turned over
        threads = [threading.Thread(target=_complete, args=(front, ACME, f"Filler {round_}.{i}: " + "a fox jumps. " * 30))
                   for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if max(_lookup(front, "acme", system).values()) == 0:
            break
    assert max(_lookup(front, "acme", system).values()) == 0  # BlockRemoved reached Dynamo's indexer
    assert _cached(_complete(front, ACME, system)) == 0  # and the worker agrees: the pages are gone


def test_a_worker_with_kv_events_endpoint_publishes_vllm_format_events(cluster):
    import zmq

    def worker_0_cached() -> bool:  # distinct prompts until the router has sent one to worker-0
        _complete(cluster["front"], ACME, f"Events {time.monotonic()}: the owl counted the stars. " * 3)
        return worker_stats(cluster["workers"][0])["num_cached_blocks"] > 0

    wait_until(worker_0_cached, timeout=60, interval=0, what="a request served (and cached) by worker-0")
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(cluster["replay"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[1] == (-1).to_bytes(8, "big", signed=True):
                break
            batches.append(msgspec.msgpack.decode(frames[2]))
    finally:
        dealer.close(0)
        context.term()
    stored = [e for batch in batches for e in batch[1] if e["type"] == "BlockStored"]  # [ts, events, dp rank]
    assert stored, "worker-0 cached blocks above, so it published them"
    assert all(len(e["token_ids"]) == 16 * len(e["block_hashes"]) == 16 * len(e["extra_keys"]) for e in stored)
    seen: set[int] = set()
    for event in stored:  # a block's parent was stored before it (the chain arrives in order)
        assert event["parent_block_hash"] is None or event["parent_block_hash"] in seen
        seen.update(event["block_hashes"])
    assert any(keys and keys[0] for e in stored for keys in e["extra_keys"])  # a tenant salt where a chain starts


def test_redis_kill_9_serving_goes_on_and_the_ledger_is_exact(cluster):
    front, redis_server = cluster["front"], cluster["redis"]
    before = _usage(front, GLOBEX)
    redis_server.kill()
    answers = [_chat(front, GLOBEX, f"While Redis is down {i}") for i in range(4)]
    redis_server.start()  # its AOF is replayed; the front door's journal then replays what Redis missed
    after = wait_until(lambda: (u := _usage(front, GLOBEX))["requests"] == before["requests"] + 4 and u,
                       timeout=30, what="the journal's replay into Redis")
    assert after["pending_records"] == 0
    assert after["prompt_tokens"] - before["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert after["completion_tokens"] - before["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in answers)
    assert after["cached_tokens"] - before["cached_tokens"] == sum(_cached(a) for a in answers)


def test_a_worker_killed_mid_stream_ends_its_streams_and_traffic_moves_on(cluster):
    front, workers = cluster["front"], cluster["workers"]
    _pin(front, "newcomers", "system: The preamble every worker holds, a newcomer too. " * 3)
    before = _usage(front, GLOBEX)
    response, lines = _stream_lines(front, GLOBEX, {"model": "stories260K", "prompt": "Once upon a time",
                                                    "max_tokens": 480, "ignore_eos": True})
    received = [json.loads(next(lines)) for _ in range(2)]
    serving = wait_until(lambda: [w for w, s in zip(workers, _all_stats(cluster)) if s["num_running"] > 0],
                         what="the request running")
    assert len(serving) == 1
    serving[0].kill()
    rest = list(lines)  # must end: an error event, then [DONE]
    assert rest[-1] == b"[DONE]"
    assert "error" in json.loads(rest[-2]), rest[-2:]
    received += [json.loads(line) for line in rest[:-2]]
    answers = [_chat(front, GLOBEX, f"After the crash {i}") for i in range(4)]  # served by the two left
    wait_until(lambda: _idle(cluster), what="the survivors idle with their pages free")
    after = _usage(front, GLOBEX)
    assert after["requests"] - before["requests"] == 5
    delivered = sum(1 for chunk in received if chunk["choices"] and chunk["choices"][0]["text"])
    billed_stream = (after["completion_tokens"] - before["completion_tokens"]
                     - sum(a["usage"]["completion_tokens"] for a in answers))
    assert delivered <= billed_stream < 480  # the killed request: the tokens that reached the front door
    # a worker joining later gets the pins
    cluster["workers"].append(start_worker("worker-3", cluster["model"], cluster["discovery"], cluster["root"],
                                           *cluster["flags"], env=cluster["env"]))
    cluster["workers"][-1].wait_ready()
    wait_until(lambda: worker_stats(cluster["workers"][-1])["num_pinned_blocks"] > 0, timeout=30,
               what="the pins on the new worker")
    _unpin(front, "newcomers")
