"""The service's own overhead (stub engine), and TTFT / inter-token latency with the real engine.

    .venv/bin/python bench/bench_service.py [--quick]

1. Overhead: a server process whose engine emits tokens instantly (bench/stub_engine.py);
   this process opens 1, 64 and 512 concurrent SSE streams and measures streamed tokens/s
   and the added latency of each token (engine thread made it -> client read it), p50/p99.
2. Real engine on stories260K: 1, 16 and 64 concurrent streams (128 tokens each); TTFT and
   inter-token latency (gap between content chunks) p50/p90/p99, output tokens/s.
Results: bench/results/service.json.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time

from common import (STORIES, free_port, log, machine_info, percentile, start_process, stop_process, wait_http,
                    write_result)

import aiohttp  # noqa: E402
import uvloop  # noqa: E402


def start_server(args: list[str], port: int):
    """Start a server (this repo's interpreter) with its own data dir; return once /ready answers."""
    proc = start_process([sys.executable, *args, "--port", str(port)],
                         env={"PAGEDSERVE_SERVER_DATA_DIR": tempfile.mkdtemp(prefix="bench-service-")})
    wait_http(f"http://127.0.0.1:{port}/ready", proc, timeout=120)
    return proc


TEXT_FIELD = re.compile(rb'"text":"([0-9 ]*)"')


async def stream_stub(session, url: str, num_tokens: int, latencies: list[float]) -> int:
    """One SSE stream; each token's text is the microsecond it was made, read back on arrival."""
    body = {"model": "stub", "prompt": "x", "max_tokens": num_tokens, "stream": True}
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        async for line in response.content:
            now_us = time.perf_counter_ns() // 1000
            for match in TEXT_FIELD.finditer(line):
                for stamp in match.group(1).split():
                    latencies.append((now_us - int(stamp)) / 1e6)
                    tokens += 1
    return tokens


async def overhead_run(url: str, concurrency: int, tokens_each: int) -> dict:
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(stream_stub(session, url, tokens_each, latencies) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    total = sum(counts)
    if total != concurrency * tokens_each:
        raise RuntimeError(f"got {total} tokens, expected {concurrency * tokens_each}")
    return {"concurrency": concurrency, "tokens": total, "seconds": round(elapsed, 3),
            "tokens_per_s": round(total / elapsed), "added_latency_ms_p50": round(1e3 * percentile(latencies, 0.5), 3),
            "added_latency_ms_p99": round(1e3 * percentile(latencies, 0.99), 3)}


async def stream_real(session, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "stories260K", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.8, "seed": hash(prompt) % 1000}
    start = time.perf_counter()
    chunk_times = []
    async with session.post(url + "/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {") and b'"text":""' not in line:
                chunk_times.append(time.perf_counter())
    return {"ttft": chunk_times[0] - start, "gaps": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "end": chunk_times[-1]}


async def real_run(url: str, concurrency: int, max_tokens: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_real(session, url, f"Story {i}: once there was", max_tokens)
                                         for i in range(concurrency)))
        elapsed = max(r["end"] for r in results) - start
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    ms = lambda v: round(1e3 * v, 2)  # noqa: E731
    return {"concurrency": concurrency, "max_tokens": max_tokens,
            "ttft_ms_p50": ms(percentile(ttfts, 0.5)), "ttft_ms_p99": ms(percentile(ttfts, 0.99)),
            "itl_ms_p50": ms(percentile(gaps, 0.5)), "itl_ms_p90": ms(percentile(gaps, 0.9)),
            "itl_ms_p99": ms(percentile(gaps, 0.99)),
            "output_tokens_per_s": round(concurrency * max_tokens / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result: dict = {"machine": machine_info()}
    port = free_port()
    proc = start_server(["bench/stub_server.py"], port)
    try:
        url = f"http://127.0.0.1:{port}"
        plan = [(1, 2000), (64, 100), (512, 20)] if args.quick else [(1, 20000), (64, 1500), (512, 200)]
        result["overhead_stub_engine"] = []
        for concurrency, tokens_each in plan:
            log(f"overhead: {concurrency} streams x {tokens_each} tokens ...")
            run = uvloop.run(overhead_run(url, concurrency, tokens_each))
            log(f"  {run}")
            result["overhead_stub_engine"].append(run)
    finally:
        stop_process(proc)
    port = free_port()
    proc = start_server(["-m", "service.cli", "serve", "--model", str(STORIES), "--max-num-seqs", "64"], port)
    try:
        url = f"http://127.0.0.1:{port}"
        result["real_engine_stories260K"] = []
        for concurrency in (1, 16, 64):
            log(f"real engine: {concurrency} streams ...")
            run = uvloop.run(real_run(url, concurrency, 32 if args.quick else 128))
            log(f"  {run}")
            result["real_engine_stories260K"].append(run)
    finally:
        stop_process(proc)
    write_result("service", args.quick, result)


if __name__ == "__main__":
    main()
