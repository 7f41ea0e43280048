"""What each API's own formatting costs: chat completions, Anthropic's Messages and OpenAI's Responses, streamed
from one stub-engine server (bench/stub_engine.py: tokens are made instantly), side by side.

    .venv/bin/python bench/bench_apis.py [--quick]

64 concurrent streams of 2,048 tokens per API, the APIs alternated in rotated order for several
rounds. Each stub token's text is the microsecond it was made, so the client counts tokens
(from the delta events only: chat chunks, Messages' content_block_delta, Responses'
response.output_text.delta) and each token's added latency. Reported per API: tokens/s
(median over rounds), its ratio to chat completions', and the latency p50/p99.
Results: bench/results/apis.json.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

from common import (alternated, free_port, log, machine_info, median, percentile, quick_mode, start_process,
                    stop_process, wait_http, write_result)

import aiohttp  # noqa: E402

APIS = ("chat", "messages", "responses")
STAMPS = re.compile(rb'"(?:content|text|delta)":"([0-9 ]+)"')
DELTA_MARKERS = {"chat": b'"chat.completion.chunk"', "messages": b'"content_block_delta"',
                 "responses": b'"response.output_text.delta"'}


def request_for(api: str, num_tokens: int) -> tuple[str, dict, dict]:
    """(path, body, headers) of one streamed request of `api` asking for `num_tokens` tokens."""
    if api == "chat":
        return "/v1/chat/completions", {"model": "stub", "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": num_tokens, "stream": True}, {}
    if api == "messages":
        return "/v1/messages", {"model": "stub", "messages": [{"role": "user", "content": "x"}],
                                "max_tokens": num_tokens, "stream": True}, {"anthropic-version": "2023-06-01"}
    return "/v1/responses", {"model": "stub", "input": "x", "max_output_tokens": num_tokens, "stream": True,
                             "store": False}, {}


async def one_stream(session, url: str, api: str, num_tokens: int, latencies: list[float]) -> int:
    path, body, headers = request_for(api, num_tokens)
    marker = DELTA_MARKERS[api]
    tokens = 0
    async with session.post(url + path, json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{api}: {response.status} {await response.text()}")
        async for line in response.content:
            if marker not in line:
                continue
            now_us = time.perf_counter_ns() // 1000
            for match in STAMPS.finditer(line):
                for stamp in match.group(1).split():
                    latencies.append((now_us - int(stamp)) / 1e6)
                    tokens += 1
    return tokens


async def run_api(url: str, api: str, concurrency: int, num_tokens: int) -> dict:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(session, url, api, num_tokens, latencies) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    total = sum(counts)
    if total != concurrency * num_tokens:
        raise RuntimeError(f"{api}: got {total} tokens, expected {concurrency * num_tokens}")
    return {"tokens_per_s": total / elapsed, "latencies": latencies}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    concurrency, num_tokens, rounds = (64, 64, 2) if args.quick else (64, 2048, 5)
    port = free_port()
    stub = Path(__file__).resolve().parent / "stub_server.py"
    proc = start_process([sys.executable, str(stub), "--port", str(port),
                          "--data-dir", tempfile.mkdtemp(prefix="bench-apis-")])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, timeout=120)
        asyncio.run(run_api(url, "chat", 8, 16))  # warm up: first connections, first requests
        runs: dict[str, list[dict]] = {api: [] for api in APIS}
        for round_index, api in alternated(APIS, rounds):
            result = asyncio.run(run_api(url, api, concurrency, num_tokens))
            runs[api].append(result)
            log(f"round {round_index + 1}/{rounds} {api}: {result['tokens_per_s']:,.0f} tokens/s")
    finally:
        stop_process(proc)
    chat = median([r["tokens_per_s"] for r in runs["chat"]])
    table = {}
    for api in APIS:
        rates = [r["tokens_per_s"] for r in runs[api]]
        latencies = [x for r in runs[api] for x in r["latencies"]]
        table[api] = {"tokens_per_s_median": round(median(rates)), "tokens_per_s_runs": [round(x) for x in rates],
                      "vs_chat": round(median(rates) / chat, 3),
                      "added_latency_ms_p50": round(1e3 * percentile(latencies, 0.5), 3),
                      "added_latency_ms_p99": round(1e3 * percentile(latencies, 0.99), 3)}
        log(f"{api}: {table[api]['tokens_per_s_median']:,} tokens/s, x{table[api]['vs_chat']} of chat, "
            f"p50 {table[api]['added_latency_ms_p50']} ms, p99 {table[api]['added_latency_ms_p99']} ms")
    write_result("apis", args.quick, {"machine": machine_info(), "concurrency": concurrency, "tokens_each": num_tokens,
                          "rounds": rounds, "apis": table})


if __name__ == "__main__":
    main()
