"""The process: SIGTERM drains (ready 503, new requests 503, running streams finish), then exits."""

import json
import signal
import threading
import time

import requests

from tests.processes import Process


def test_sigterm_lets_running_streams_finish_and_refuses_new_work(stories_dir, tmp_path):
    env = {"PAGEDSERVE_SERVER_SHUTDOWN_TIMEOUT_S": "20", "PAGEDSERVE_ENGINE_NUM_BLOCKS": "128",
           "PAGEDSERVE_SERVER_DATA_DIR": str(tmp_path)}
    server = Process("lifecycle", ["serve", "--model", str(stories_dir), "--port", "0"], 0, tmp_path, env)
    try:
        server.wait_ready()
        url = server.url
        assert requests.get(url + "/health", timeout=5).json() == {"status": "ok"}
        events: list[bytes] = []

        def stream():
            body = {"model": "stories260K", "prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True,
                    "temperature": 0, "n": 8}  # long enough to still run after the checks below
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        while not events:
            time.sleep(0.01)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10  # the signal is handled on the loop: /ready turns 503 once it is
        while (ready := requests.get(url + "/ready", timeout=5).status_code) != 503 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready == 503 and reader.is_alive()  # draining, with the stream still running
        refused = requests.post(url + "/v1/completions", json={"model": "stories260K", "prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
        reader.join(60)
        assert events[-1] == b"data: [DONE]"
        chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
        reasons = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
        assert reasons == dict.fromkeys(range(8), "length")  # every sample ran to the end, not aborted
        assert server.process.wait(30) == 0
    finally:
        server.stop()


def test_metrics_expose_the_documented_names(server):
    requests.post(server.url + "/v1/completions", json={"model": "stories260K", "prompt": "Hi", "max_tokens": 3}, timeout=30)
    text = requests.get(server.url + "/metrics", timeout=10).text
    for name in ("pagedserve_num_requests_running", "pagedserve_num_requests_waiting", "pagedserve_kv_blocks_total",
                 "pagedserve_kv_blocks_in_use", "pagedserve_kv_blocks_cached", "pagedserve_prefix_cache_queries_total",
                 "pagedserve_prefix_cache_hits_total", "pagedserve_num_preemptions_total",
                 "pagedserve_prompt_tokens_total", "pagedserve_generation_tokens_total",
                 "pagedserve_time_to_first_token_seconds_bucket", "pagedserve_inter_token_latency_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert "pagedserve_kv_blocks_total 256.0" in text


def test_the_engine_steps_on_the_thread_that_built_it(stories_dir):
    # torch's OpenMP pool is per OS thread: building on one thread and stepping on another
    # leaves two pools competing for the cores (service/bridge/engine_thread.py)
    from service.app import load_engine
    from tests.service.conftest import run_server, stories_settings
    from tests.service.http import json_body

    threads = {"built": None, "stepped": set()}

    def factory(settings):
        threads["built"] = threading.get_ident()
        engine = load_engine(settings)
        real_step = engine.step

        def step():
            threads["stepped"].add(threading.get_ident())
            return real_step()

        engine.step = step
        return engine

    with run_server(stories_settings(stories_dir), factory) as server:
        body = json_body(server, "/v1/completions", {"model": "stories260K", "prompt": "Once upon a time",
                                                       "max_tokens": 4, "ignore_eos": True})
        assert body["usage"]["completion_tokens"] == 4
    assert threads["stepped"] == {threads["built"]}
    assert threads["built"] not in (threading.main_thread().ident, threading.get_ident())
