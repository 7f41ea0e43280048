"""A stored conversation continued with `previous_response_id`: how much of turn 2's prompt is read from the
prefix cache, and its time to first token against sending the whole history cold.

    .venv/bin/python bench/bench_responses_cache.py [--quick] [--model PATH] [--dtype float32]

One `pagedserve serve` process (default: SmolLM2-135M-Instruct's Q4_1 GGUF, float32). Per trial:
turn 1 is a ~1,000-token prompt (instructions + a document) answered with 48 tokens (greedy);
turn 2 asks one more question with `previous_response_id`, streamed; "cold" sends the same
conversation (the document, turn 1's answer as an assistant message, the question) as input
items under a fresh `cache_salt`, so nothing of it is cached. Warm and cold alternate in
order per trial; every trial has its own salt, so trials never share pages. Reported: turn 2's
cached share of its prompt, TTFT warm and cold (client-side, request sent -> first
output_text.delta), and their ratio (medians).
Results: bench/results/responses_cache.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import requests

from common import free_port, log, machine_info, median, quick_mode, start_process, stop_process, wait_http, write_result
from smollm2 import gguf_file

INSTRUCTIONS = "You are a careful assistant. Answer from the document only, in plain words."
FACTS = ["The bakery on Mill Street opens at seven and closes at six, every day but Sunday.",
         "Its rye bread is baked twice a day, at six in the morning and at noon.",
         "The cakes are made to order and need two days' notice.",
         "A loaf of white bread costs three euros; a loaf of rye costs four.",
         "The owner, Marta, learned to bake from her grandmother in Krakow.",
         "On Saturdays there is a market stall by the river with pastries and coffee.",
         "Deliveries go to the old town on Tuesdays and Fridays.",
         "Gluten-free bread is sold on Wednesdays only."]
QUESTION = "In one sentence: when can I buy gluten-free bread?"


def document(trial: int, target_tokens: int, url: str) -> str:
    """About `target_tokens` tokens of numbered facts (trial-specific text from the first word)."""
    lines, count = [f"Document {trial}: notes on the bakery."], 0
    while count < target_tokens:
        lines.append(f"{len(lines)}. {FACTS[len(lines) % len(FACTS)]}")
        body = {"messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "\n".join(lines)}]}
        count = requests.post(url + "/tokenize", json=body, timeout=30).json()["count"]
    return "\n".join(lines)


def streamed(url: str, body: dict) -> dict:
    """POST a streamed response: TTFT (first output_text.delta) and the final response object."""
    start = time.perf_counter()
    ttft = None
    final = None
    with requests.post(url + "/v1/responses", json={**body, "stream": True}, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete", "response.failed"):
                final = event["response"]
    return {"ttft_s": ttft, "response": final}


def messages_reuse(url: str, name: str, doc: str) -> dict:
    """Two /v1/messages calls sharing a cache_control system prompt: what the second reads from the cache,
    against the full pages of the prefix the two prompts share (counted with /tokenize)."""
    salt = f"messages-{time.time_ns()}"
    system = [{"type": "text", "text": doc, "cache_control": {"type": "ephemeral"}}]
    questions = ("When does the bakery open?", "What does rye bread cost?")
    usages = []
    for question in questions:
        answer = requests.post(url + "/v1/messages", timeout=600, json={
            "model": name, "max_tokens": 8, "temperature": 0, "system": system, "cache_salt": salt,
            "messages": [{"role": "user", "content": question}]}).json()
        usages.append(answer["usage"])
    prompts = [requests.post(url + "/tokenize", timeout=30, json={"messages": [
        {"role": "system", "content": doc}, {"role": "user", "content": q}]}).json()["tokens"] for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    return {"first": usages[0], "second": usages[1], "shared_prefix_tokens": shared,
            "shared_prefix_full_pages_tokens": shared // 16 * 16,
            "second_reads_the_whole_prefix": usages[1]["cache_read_input_tokens"] == shared // 16 * 16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="a checkpoint folder or GGUF (default: SmolLM2's Q4_1 GGUF)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    args = parser.parse_args()
    quick_mode(args.quick)
    trials = 2 if args.quick else 6
    model = str(args.model or gguf_file())
    port = free_port()
    proc = start_process([sys.executable, "-m", "service.cli", "serve", "--model", model, "--dtype", args.dtype,
                          "--port", str(port), "--data-dir", tempfile.mkdtemp(prefix="bench-responses-")])
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait_http(url + "/ready", proc, timeout=300)
        name = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        streamed(url, {"model": name, "input": "Hello", "max_output_tokens": 4, "store": False})  # warm up
        for trial in range(trials):
            salt = f"trial-{trial}-{time.time_ns()}"
            doc = document(trial, args.prompt_tokens, url)
            first = requests.post(url + "/v1/responses", timeout=600, json={
                "model": name, "instructions": INSTRUCTIONS, "input": doc, "max_output_tokens": 48, "temperature": 0,
                "cache_salt": salt}).json()
            answer = first["output"][0]["content"][0]["text"]
            warm_body = {"model": name, "instructions": INSTRUCTIONS, "previous_response_id": first["id"],
                         "input": QUESTION, "max_output_tokens": 8, "temperature": 0, "cache_salt": salt,
                         "store": False}
            cold_body = {"model": name, "instructions": INSTRUCTIONS, "max_output_tokens": 8, "temperature": 0,
                         "cache_salt": f"{salt}-cold", "store": False,
                         "input": [{"role": "user", "content": doc}, {"role": "assistant", "content": answer},
                                   {"role": "user", "content": QUESTION}]}
            order = (("warm", warm_body), ("cold", cold_body)) if trial % 2 == 0 else (("cold", cold_body),
                                                                                        ("warm", warm_body))
            got = {kind: streamed(url, body) for kind, body in order}
            warm, cold = got["warm"], got["cold"]
            usage = warm["response"]["usage"]
            row = {"trial": trial, "turn1_input_tokens": first["usage"]["input_tokens"],
                   "turn2_input_tokens": usage["input_tokens"],
                   "turn2_cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                   "cached_share": round(usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"], 4),
                   "cold_input_tokens": cold["response"]["usage"]["input_tokens"],
                   "cold_cached_tokens": cold["response"]["usage"]["input_tokens_details"]["cached_tokens"],
                   "ttft_warm_s": round(warm["ttft_s"], 4), "ttft_cold_s": round(cold["ttft_s"], 4),
                   "same_answer": warm["response"]["output"][0]["content"][0]["text"]
                   == cold["response"]["output"][0]["content"][0]["text"]}
            rows.append(row)
            log(f"trial {trial + 1}/{trials}: {row}")
        messages = messages_reuse(url, name, document(trials, args.prompt_tokens, url))
        log(f"messages: {messages}")
    finally:
        stop_process(proc)
    summary = {"cached_share_median": median([r["cached_share"] for r in rows]),
               "cached_share_min": min(r["cached_share"] for r in rows),
               "ttft_warm_s_median": median([r["ttft_warm_s"] for r in rows]),
               "ttft_cold_s_median": median([r["ttft_cold_s"] for r in rows]),
               "all_answers_equal": all(r["same_answer"] for r in rows)}
    summary["ttft_warm_over_cold"] = round(summary["ttft_warm_s_median"] / summary["ttft_cold_s_median"], 3)
    log(f"summary: {summary}")
    write_result("responses_cache", args.quick, {"machine": machine_info(), "model": model.rsplit("/", 1)[-1],
                                                 "dtype": args.dtype, "trials": rows, "summary": summary,
                                                 "messages": messages})


if __name__ == "__main__":
    main()
