"""Speculation behind Dynamo: the worker drafts (its --speculative-config), the front door's
`prediction` reaches it, and the answers are the embedded engine's."""

from __future__ import annotations

import json

import requests

from runtime import Engine, SamplingParams
from tests.distributed.cluster import start_front_door, start_worker, wait_until, worker_stats

STORY = "Lily and Tom went to the park. Lily and Tom saw a big tree. Lily and Tom"
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


def test_workers_speculate_and_predictions_cross_the_request_plane(tmp_path, stories_dir):
    discovery = tmp_path / "discovery"
    worker = start_worker("worker-spec", stories_dir, discovery, tmp_path, "--num-blocks", "256",
                          "--speculative-config", SPEC)
    processes = [worker]
    try:
        worker.wait_ready()
        front = start_front_door(stories_dir, discovery, tmp_path / "data", tmp_path)
        processes.append(front)
        front.wait_ready(check=lambda body: body["workers"] == 1)
        want = Engine.from_pretrained(stories_dir).generate(STORY, SamplingParams(max_tokens=40, temperature=0))[0]
        body = {"model": "stories260K", "prompt": STORY, "max_tokens": 40, "temperature": 0}
        answer = requests.post(front.url + "/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == want.outputs[0].text
        assert worker_stats(worker)["spec_decode_num_draft_tokens"] > 0

        chat = {"model": "stories260K", "messages": [{"role": "user", "content": STORY}], "max_tokens": 40,
                "temperature": 0}
        plain = requests.post(front.url + "/v1/chat/completions", json=chat, timeout=60).json()
        text = plain["choices"][0]["message"]["content"]
        predicted = requests.post(front.url + "/v1/chat/completions", timeout=60,
                                  json={**chat, "prediction": {"type": "content", "content": text}}).json()
        assert predicted["choices"][0]["message"]["content"] == text
        # How many drafts a step takes is the timed cost model's call (a loaded machine drafts fewer), so
        # this asks only that the prediction reached the worker and was drafted from.
        accepted = predicted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
        assert accepted > 0
        def accepted_at_front_door() -> float:  # summed over the workers' stats, polled every half second
            text = requests.get(front.url + "/metrics", timeout=5).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))

        wait_until(lambda: accepted_at_front_door() >= accepted, timeout=10, what="the front door's spec-decode counters")
    finally:
        for process in processes:
            process.stop()
