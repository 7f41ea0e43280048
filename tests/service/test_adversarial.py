"""A tenant attacking the server, against a real `pagedserve serve` process with two tenants.

Each attack asserts the status and the error's shape (OpenAI's, or Anthropic's on /v1/messages),
then that the server is still well: /health answers, no KV page is left in use, and the
tenants' bills did not move for what was refused.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest
import requests

from tests.processes import Process
from tests.service.conftest import write_tenants_file

KEY_A, KEY_B, ADMIN_KEY = "sk-tenant-a", "sk-tenant-b", "sk-admin"
KEY_METERED, KEY_FRUGAL = "sk-tenant-metered", "sk-tenant-frugal"  # 5 requests a minute; 1,000 tokens a minute
DEEP = 10_000  # far past any parser's recursion limit
IDLE_TIMEOUT_S, MAX_CONNECTIONS_PER_IP, MAX_REQUESTS_PER_CONNECTION, BODY_TIMEOUT_S = 3.0, 64, 5, 2.0
ATTACKER, OTHER_ATTACKER = "127.0.0.2", "127.0.0.3"  # loopback addresses apart from the tests' own 127.0.0.1


def _auth(key: str, anthropic: bool = False) -> dict[str, str]:
    return {"x-api-key": key} if anthropic else {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adversarial")
    tenants = write_tenants_file(folder / "tenants.toml", {
        "a": {"keys": [KEY_A], "plan": "standard"},
        "b": {"keys": [KEY_B], "plan": "standard"},
        "metered": {"keys": [KEY_METERED], "plan": "standard", "requests_per_minute": 5},
        "frugal": {"keys": [KEY_FRUGAL], "plan": "standard", "tokens_per_minute": 1000},
    }, admin_keys=[ADMIN_KEY])
    process = Process("adversarial", ["serve", "--model", str(stories_dir), "--port", "0", "--data-dir", str(folder),
                                      "--tenants", str(tenants), "--num-blocks", "256", "--max-num-seqs", "16"],
                      0, folder, {"PAGEDSERVE_SERVER_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S),
                                  "PAGEDSERVE_SERVER_MAX_CONNECTIONS_PER_IP": str(MAX_CONNECTIONS_PER_IP),
                                  "PAGEDSERVE_SERVER_MAX_REQUESTS_PER_CONNECTION": str(MAX_REQUESTS_PER_CONNECTION),
                                  "PAGEDSERVE_SERVER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def _metric(server: Process, name: str) -> float:
    text = requests.get(server.url + "/metrics", headers=_auth(ADMIN_KEY), timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _bill(server: Process, key: str) -> dict:
    body = requests.get(server.url + "/v1/usage", headers=_auth(key), timeout=10).json()
    return {k: v for k, v in body.items() if k != "pending_records"}


@pytest.fixture
def well(server):
    """The server is well after the test: it answers, and holds no page for a request."""
    yield
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert _metric(server, "pagedserve_kv_blocks_in_use") == 0


@pytest.fixture
def unbilled(server, well):
    """... and what the test sent was refused whole: no tenant's bill moved."""
    bills = {key: _bill(server, key) for key in (KEY_A, KEY_B)}
    yield
    assert {key: _bill(server, key) for key in (KEY_A, KEY_B)} == bills


def _deep(leaf: str = "1") -> str:
    return '{"a":' * DEEP + leaf + "}" * DEEP


USER = '"model":"stories260K","messages":[{"role":"user","content":"hi"}]'
DEEP_BODIES = {  # (route, body): a nested value in each place a caller can put one
    "chat metadata": ("/v1/chat/completions", '{' + USER + ',"max_tokens":1,"metadata":' + _deep() + "}"),
    "chat guided_json": ("/v1/chat/completions", "{" + USER + ',"max_tokens":1,"guided_json":' + _deep() + "}"),
    "chat response_format anyOf": ("/v1/chat/completions", "{" + USER + ',"max_tokens":1,"response_format":{"type":'
                                   '"json_schema","json_schema":{"name":"x","schema":' + '{"anyOf":[' * 2000
                                   + '{"type":"string"}' + "]}" * 2000 + "}}}"),
    "chat schema as text": ("/v1/chat/completions", "{" + USER + ',"max_tokens":1,"guided_json":'
                            + json.dumps(_deep()) + "}"),
    "completions": ("/v1/completions", '{"prompt":"hi","max_tokens":1,"logit_bias":' + _deep() + "}"),
    "tokenize": ("/tokenize", '{"prompt":' + _deep() + "}"),
    "detokenize": ("/detokenize", '{"tokens":' + "[" * DEEP + "]" * DEEP + "}"),
    "messages tools": ("/v1/messages", '{"max_tokens":1,' + USER + ',"tools":[{"name":"f",'
                       '"input_schema":' + _deep() + "}]}"),
    "count_tokens": ("/v1/messages/count_tokens", '{' + USER + ',"system":' + _deep() + "}"),
    "responses tools": ("/v1/responses", '{"model":"stories260K","input":"hi","max_output_tokens":1,"tools":'
                        '[{"type":"function","name":"f","parameters":' + _deep() + "}]}"),
    "pin": ("/v1/pinned-prefixes", '{"id":"p","text":' + _deep() + "}"),
}


@pytest.mark.parametrize("case", DEEP_BODIES)
def test_deep_json_is_a_400_in_the_apis_shape(server, unbilled, case):
    path, body = DEEP_BODIES[case]
    anthropic = path.startswith("/v1/messages")
    response = requests.post(server.url + path, data=body, timeout=30,
                             headers={"Content-Type": "application/json", **_auth(KEY_B, anthropic)})
    assert response.status_code == 400, response.text
    error = response.json()
    if anthropic:
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert "levels deep" in error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == "json_too_deep"


def test_tool_call_arguments_nested_past_the_limit_stay_text(server, unbilled):
    """Arguments are text the template may show as an object: past the depth limit they are shown as the
    text they are (never parsed), here too long for stories260K's 512-token context."""
    body = {"model": "stories260K", "max_tokens": 1, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": _deep()}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}]}
    response = requests.post(server.url + "/v1/chat/completions", json=body, headers=_auth(KEY_B), timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"


WIDE_BODIES = {  # (route, body, the code): within the depth limit, past a count
    "chat with 5,000 tools": ("/v1/chat/completions", {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]},
                              "too_many_tools"),
    "chat with 10,000 messages": ("/v1/chat/completions", {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}] * 10_000,
                                  "max_tokens": 1}, "too_many_messages"),
    "a schema of 40,000 values": ("/v1/chat/completions", {
        "model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}}}},
        "schema_too_large"),
    "tools' schemas of 40,000 values": ("/v1/chat/completions", {
        "model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "tools": [{"type": "function", "function": {"name": f"f{t}", "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}}} for t in range(10)]},
        "schema_too_large"),
}


@pytest.mark.parametrize("case", WIDE_BODIES)
def test_wide_json_is_a_400_naming_the_limit(server, unbilled, case):
    path, body, code = WIDE_BODIES[case]
    response = requests.post(server.url + path, json=body, headers=_auth(KEY_B), timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code, response.text


@pytest.mark.parametrize("path, frame, then", [
    ("/v1/stream", '{"type":"request","id":"deep","body":' + _deep() + "}",
     {"type": "request", "id": "ok", "body": {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}),
    ("/v1/responses", '{"type":"response.create","input":' + _deep() + "}",
     {"type": "response.create", "model": "stories260K", "input": "hi", "max_output_tokens": 2}),
])
def test_a_deep_websocket_frame_gets_an_error_frame_and_the_socket_serves_on(server, well, path, frame, then):
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url + path, headers=_auth(KEY_B)) as ws:
                await ws.send_str(frame)
                error = await ws.receive_json(timeout=30)
                await ws.send_json(then)  # the same socket still serves
                while True:
                    event = await ws.receive_json(timeout=30)
                    if event["type"] in ("done", "response.completed", "response.incomplete", "error"):
                        return error, event

    error, last = asyncio.run(main())
    assert error["type"] == "error" and error["error"]["code"] == "json_too_deep"
    assert last["type"] != "error", last


def _a_fresh_minute() -> None:
    """Limits count calendar minutes: start where five requests cannot straddle two."""
    if time.time() % 60 > 45:
        time.sleep(60 - time.time() % 60 + 0.5)


def test_requests_refused_or_never_generating_count_against_the_requests_limit(server):
    _a_fresh_minute()
    anthropic = {"Content-Type": "application/json", "anthropic-version": "2023-06-01", **_auth(KEY_METERED, True)}
    sent = [
        requests.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=_auth(KEY_METERED), timeout=30),
        requests.post(server.url + "/detokenize", json={"tokens": [1, 2]}, headers=_auth(KEY_METERED), timeout=30),
        requests.post(server.url + "/v1/messages/count_tokens", headers=anthropic, timeout=30,
                      json={"model": "stories260K", "messages": [{"role": "user", "content": "hi"}]}),
        requests.post(server.url + "/v1/chat/completions", headers=_auth(KEY_METERED), timeout=30,
                      json={"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
        requests.post(server.url + "/v1/chat/completions", headers=_auth(KEY_METERED), timeout=30,
                      json={"model": "stories260K", "messages": [{"role": "user", "content": "hi " * 2000}]}),
    ]
    sixth = requests.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=_auth(KEY_METERED), timeout=30)
    assert [r.status_code for r in sent] == [200, 200, 200, 400, 400], [r.text for r in sent]
    assert sixth.status_code == 429 and sixth.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(sixth.headers["Retry-After"]) <= 60


def test_a_body_past_the_tokens_limit_is_refused_before_it_is_read(server, well):
    _a_fresh_minute()
    body = {"prompt": "the cat sat on the mat. " * 1000}  # ~24 KB: charged ~1,500 tokens on arrival
    refused = requests.post(server.url + "/tokenize", json=body, headers=_auth(KEY_FRUGAL), timeout=30)
    assert refused.status_code == 429, refused.text
    assert "tokens_per_minute" in refused.json()["error"]["message"]


def test_a_flood_of_big_bodies_leaves_the_other_tenant_served(server, well):
    """Tenant B keeps 16 x 1 MB /tokenize and oversize chats in flight; tenant A's chats and /health are
    answered all along (bench/bench_tenant_flood.py measures how fast), and B's are answered too."""
    text = "the cat sat on the mat. " * 43_000  # 1,032,000 bytes: under the 1 MiB body limit
    floods = [("/tokenize", {"prompt": text}), ("/v1/chat/completions", {"model": "stories260K", "max_tokens": 1,
                                                                       "messages": [{"role": "user", "content": text}]})]

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def post(key, path, body):
                async with session.post(server.url + path, json=body, headers=_auth(key)) as response:
                    return response.status, await response.json()

            flood = [asyncio.ensure_future(post(KEY_B, *floods[i % 2])) for i in range(16)]
            answers = []
            while not all(f.done() for f in flood) or len(answers) < 3:
                async with session.get(server.url + "/health") as health:
                    answers.append(("health", health.status))
                answers.append(await post(KEY_A, "/v1/chat/completions", {
                    "model": "stories260K", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}))
            return await asyncio.gather(*flood), answers

    flood, answers = asyncio.run(main())
    assert [status for status, _ in flood] == [200, 400] * 8
    assert flood[0][1]["count"] > 100_000
    assert all(body["error"]["code"] == "context_length_exceeded" for _, body in flood[1::2])
    assert all((answer[1] == 200) if answer[0] == "health" else (answer[0] == 200) for answer in answers), answers


def _connect_from(address: str, server: Process) -> socket.socket:
    sock = socket.socket()
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    return sock


def _closed_by_server(sock: socket.socket, timeout_s: float) -> bool:
    """True once the server closed `sock` (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_slowloris_heads_and_silent_sockets_are_closed_by_the_header_timeout(server, well):
    socks = [_connect_from(ATTACKER, server) for _ in range(32)]
    opened = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64
    try:
        for i in range(int(IDLE_TIMEOUT_S / 0.25) + 8):  # a byte every 0.25 s per socket, past the timeout
            for sock in socks[: len(socks) // 2]:  # half send a slow head, half send nothing
                try:
                    sock.send(head[i: i + 1])
                except OSError:
                    pass
            if i % 4 == 0:
                assert requests.get(server.url + "/health", timeout=5).status_code == 200  # others are served
            time.sleep(0.25)
        closed = [_closed_by_server(sock, max(0.1, opened + IDLE_TIMEOUT_S + 5 - time.monotonic())) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(closed), f"{closed.count(False)} of {len(socks)} sockets still open"


def test_a_long_request_outlives_the_idle_timeout(server, well):
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url + "/v1/stream", headers=_auth(KEY_A)) as ws:
                await asyncio.sleep(IDLE_TIMEOUT_S + 1)  # an upgraded socket is a request being handled
                await ws.send_json({"type": "request", "id": "late", "body": {
                    "model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}})
                while (event := await ws.receive_json(timeout=30))["type"] not in ("done", "error"):
                    pass
                return event

    assert asyncio.run(main())["type"] == "done"


def test_an_address_past_its_connection_cap_is_refused_and_others_are_not(server, well):
    socks = [_connect_from(OTHER_ATTACKER, server) for _ in range(MAX_CONNECTIONS_PER_IP)]
    try:
        one_more = _connect_from(OTHER_ATTACKER, server)  # accepted after the first 64: past the cap
        refused = _closed_by_server(one_more, 5.0)
        one_more.close()
        served = requests.get(server.url + "/health", timeout=5).status_code  # from 127.0.0.1
    finally:
        for sock in socks:
            sock.close()
    assert refused and served == 200

    def health_from_the_attacker() -> bytes:
        again = _connect_from(OTHER_ATTACKER, server)
        try:
            again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            again.settimeout(5)
            return again.recv(4096)
        except ConnectionResetError:
            return b""
        finally:
            again.close()

    deadline = time.monotonic() + 10  # the closes reach the server in their own time: then the address is let in
    while not (answer := health_from_the_attacker()) and time.monotonic() < deadline:
        pass
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_metrics_need_the_admin_key(server):
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 401
    tenant = requests.get(server.url + "/metrics", headers=_auth(KEY_A), timeout=10)
    assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "admin_key_required"
    admin = requests.get(server.url + "/metrics", headers=_auth(ADMIN_KEY), timeout=10)
    assert admin.status_code == 200 and "pagedserve_kv_blocks_in_use" in admin.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{' + USER + ',"temperature":1e999}', "temperature"),
    ("/v1/chat/completions", '{' + USER + ',"metadata":{"a":[1,-1e999]}}', "metadata.a[1]"),
    ("/v1/chat/completions", '{' + USER + ',"logprobs":true,"top_logprobs":1000000000}', "top_logprobs"),
    ("/v1/completions", '{"model":"stories260K","prompt":"hi","best_of":1000000}', "best_of"),
    ("/v1/completions", '{"model":"stories260K","prompt":"hi","n":1000000}', "n"),
])
def test_an_out_of_range_value_is_named_as_the_caller_named_it(server, unbilled, path, body, param):
    response = requests.post(server.url + path, data=body, timeout=30,
                             headers={"Content-Type": "application/json", **_auth(KEY_B)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_messages_without_a_key_asks_for_x_api_key(server):
    response = requests.post(server.url + "/v1/messages", timeout=10, headers={"anthropic-version": "2023-06-01"},
                             json={"model": "stories260K", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 401
    assert response.json()["error"] == {"type": "authentication_error", "message": "x-api-key header is required"}


def _text_of(server: Process, num_tokens: int, words: str = "once upon a time a little fox ran to the owl ") -> str:
    """`words` repeated until the text is at least `num_tokens` tokens."""
    text = ""
    while requests.post(server.url + "/tokenize", json={"prompt": text}, headers=_auth(ADMIN_KEY),
                        timeout=30).json()["count"] < num_tokens:
        text += words
    return text


def _pin(server: Process, key: str, pin_id: str, text: str) -> requests.Response:
    return requests.post(server.url + "/v1/pinned-prefixes", json={"id": pin_id, "text": text}, headers=_auth(key),
                         timeout=30)


def test_a_tenant_at_its_pin_budget_leaves_the_others_theirs_and_pays_for_its_pins(server, well):
    """Four tenants share the 64-page pin budget: 16 pages each. B holds 12 and is refused 6 more; A still pins.
    Each pin's prefill is on its own tenant's bill, and on no one else's."""
    big, more, small = _text_of(server, 12 * 16), "story " + _text_of(server, 6 * 16), "tale " + _text_of(server, 32)
    bills = {key: _bill(server, key) for key in (KEY_A, KEY_B)}
    try:
        held = _pin(server, KEY_B, "big", big)
        refused = _pin(server, KEY_B, "more", more)
        other = _pin(server, KEY_A, "small", small)
        assert held.status_code == 201 and other.status_code == 201, (held.text, other.text)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "pin_budget_exceeded"
        for key, answer in ((KEY_B, held), (KEY_A, other)):
            bill, before = _bill(server, key), bills[key]
            assert bill["requests"] == before["requests"] + 1
            assert bill["prompt_tokens"] - before["prompt_tokens"] == answer.json()["usage"]["prompt_tokens"] > 0
            assert bill["cached_tokens"] - before["cached_tokens"] == answer.json()["usage"]["cached_tokens"]
    finally:
        for key, pin_id in ((KEY_B, "big"), (KEY_B, "more"), (KEY_A, "small")):
            requests.delete(server.url + f"/v1/pinned-prefixes/{pin_id}", headers=_auth(key), timeout=10)


def test_an_operators_pin_for_a_tenant_is_neither_counted_nor_billed_as_the_tenants(server, well):
    text = _text_of(server, 20 * 16, "the house rules for every story told here ")  # past A's 16-page share
    bill = _bill(server, KEY_A)
    try:
        pinned = requests.post(server.url + "/v1/pinned-prefixes", params={"tenant": "a"}, timeout=30,
                               json={"id": "house", "text": text}, headers=_auth(ADMIN_KEY))
        assert pinned.status_code == 201 and pinned.json()["by_operator"] is True, pinned.text
        assert pinned.json()["usage"]["prompt_tokens"] > 16 * 16  # past A's own share: not counted in it
        assert _pin(server, KEY_A, "own", "a small pin of a few words for the fox " * 3).status_code == 201
        listed = requests.get(server.url + "/v1/pinned-prefixes", headers=_auth(KEY_A), timeout=10).json()["data"]
        assert {(p["id"], p["by_operator"]) for p in listed} == {("house", True), ("own", False)}
        assert _bill(server, KEY_A)["requests"] == bill["requests"] + 1  # A's own pin only
    finally:
        for pin_id in ("house", "own"):
            requests.delete(server.url + f"/v1/pinned-prefixes/{pin_id}", headers=_auth(KEY_A), timeout=10)


HUGE = {  # (route, body, status, code or param): past a limit the server checks, each refused whole
    "a 50 MB body": ("/v1/chat/completions", b'{"model":"stories260K","messages":[{"role":"user","content":"'
                     + b"a" * (50 << 20) + b'"}]}', 413, None),
    "n of a million": ("/v1/chat/completions", {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}],
                                               "n": 1_000_000}, 400, "n"),
    "max_tokens of a trillion": ("/v1/completions", {"model": "stories260K", "prompt": "hi", "max_tokens": 10**12},
                                 400, "context_length_exceeded"),
    "10,000 stop strings": ("/v1/chat/completions", {"model": "stories260K", "messages": [{"role": "user", "content": "hi"}],
                                                    "stop": [f"s{i}" for i in range(10_000)]}, 400, "stop"),
}


@pytest.mark.parametrize("case", HUGE)
def test_huge_requests_are_refused_whole(server, unbilled, case):
    path, body, status, code = HUGE[case]
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    response = requests.post(server.url + path, headers={"Content-Type": "application/json", **_auth(KEY_B)},
                             timeout=60, **kwargs)
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert code is None or code in (error.get("code"), error.get("param")), error


@pytest.mark.parametrize("constraint", [
    {"guided_regex": "(a|b)*a(a|b){40}"},  # a DFA of 2^40 states, were it built
    {"guided_regex": "(a+)+$"},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": "^(a|aa)+$"}}, "required": ["p"]}}}},
])
def test_redos_patterns_answer_or_refuse_in_time(server, well, constraint):
    response = requests.post(server.url + "/v1/chat/completions", headers=_auth(KEY_B), timeout=60, json={
        "model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **constraint})
    assert response.status_code in (200, 400), response.text[:500]


def test_another_tenants_things_read_as_absent(server, well):
    chat = {"model": "stories260K", "messages": [{"role": "user", "content": "A's secret: the owl's name is Hoot."}],
            "max_tokens": 2, "user": "alice"}
    first = requests.post(server.url + "/v1/chat/completions", json=chat, headers=_auth(KEY_A), timeout=30).json()
    stored = requests.post(server.url + "/v1/responses", headers=_auth(KEY_A), timeout=30, json={
        "model": "stories260K", "input": "A's stored answer", "max_output_tokens": 2}).json()
    own_pin = _pin(server, KEY_A, "a-secret", "A's pinned secret about the owl " * 4)
    try:
        reads = [requests.get(server.url + f"/v1/responses/{stored['id']}", headers=_auth(KEY_B), timeout=10),
                 requests.get(server.url + "/v1/usage", params={"tenant": "a"}, headers=_auth(KEY_B), timeout=10),
                 requests.delete(server.url + "/v1/pinned-prefixes/a-secret", headers=_auth(KEY_B), timeout=10)]
        pins = requests.get(server.url + "/v1/pinned-prefixes", headers=_auth(KEY_B), timeout=10).json()["data"]
        probes = [requests.post(server.url + "/v1/chat/completions", headers=_auth(KEY_B), timeout=30,
                                json={**chat, **extra}).json()
                  for extra in ({"cache_salt": "alice"}, {"user": "alice"})]  # each B's first in its scope
        again = requests.post(server.url + "/v1/chat/completions", json=chat, headers=_auth(KEY_A), timeout=30).json()
    finally:
        requests.delete(server.url + "/v1/pinned-prefixes/a-secret", headers=_auth(KEY_A), timeout=10)
    assert first["usage"]["prompt_tokens"] > 0 and own_pin.status_code == 201
    assert [r.status_code for r in reads] == [404, 404, 404]
    assert all("a-secret" != p["id"] for p in pins)
    assert [p["usage"]["prompt_tokens_details"]["cached_tokens"] for p in probes] == [0, 0]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the probe could have seen a hit


def test_a_websocket_flood_is_answered_frame_by_frame(server, well):
    frames = 300

    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(server.url + "/v1/stream", headers=_auth(KEY_B)) as ws:
                for i in range(frames):  # all at once, half of them bad
                    if i % 2:
                        await ws.send_str('{"type":"request","id":"bad' + str(i) + '","body":{"model":1}}')
                    else:
                        await ws.send_json({"type": "request", "id": f"r{i}", "body": {
                            "model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}})
                ended: dict[str, str] = {}
                while len(ended) < frames:
                    event = await ws.receive_json(timeout=60)
                    if event["type"] in ("done", "error"):
                        ended[event["id"]] = event["type"]
                return ended

    ended = asyncio.run(main())
    assert sum(kind == "done" for kind in ended.values()) == frames // 2
    assert all(kind == "error" for request_id, kind in ended.items() if request_id.startswith("bad"))


def test_a_keep_alive_connection_closes_after_its_last_request(server):
    sock = _connect_from(ATTACKER, server)
    try:  # one more request than the cap, pipelined: the cap's last answer closes the connection
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * (MAX_REQUESTS_PER_CONNECTION + 1))
        sock.settimeout(10)  # an open connection would time out here, not end
        answers = b""
        while chunk := sock.recv(65536):
            answers += chunk
    finally:
        sock.close()
    heads = [head for head in answers.split(b"HTTP/1.1 ")[1:]]
    assert len(heads) == MAX_REQUESTS_PER_CONNECTION and all(h.startswith(b"200") for h in heads), answers[:500]
    assert b"connection: close" in heads[-1].lower() and b"connection: close" not in heads[0].lower()


def test_a_body_sent_too_slowly_is_a_408_and_the_connection_closes(server, unbilled):
    sock = _connect_from(ATTACKER, server)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY_B.encode() + b"\r\nContent-Length: 100000\r\n\r\n{\"model\":")
        sock.settimeout(BODY_TIMEOUT_S + 10)  # the rest of the body never comes
        answer = b""
        while chunk := sock.recv(65536):  # until the server closes the connection (or the timeout raises)
            answer += chunk
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"request_timeout"' in answer
