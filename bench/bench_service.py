"""The service's own overhead (stub engine), and TTFT / inter-token latency with the real engine.

    .venv/bin/python bench/bench_service.py [--quick]

1. Overhead: a server process whose engine emits tokens instantly (bench/stub_engine.py);
   this process opens 1, 64 and 512 concurrent SSE streams and measures streamed tokens/s
   and the added latency of each token (engine thread made it -> client read it), p50/p99.
2. Real engine on stories260K: 1, 16 and 64 concurrent streams (128 tokens each); TTFT and
   inter-token latency (gap between content chunks) p50/p90/p99, output tokens/s.
3. What durable billing costs (a request's last message waits until its usage record is
   fsynced): two stub servers side by side, one with server.reply_after_usage_on_disk = true
   (the default), one with false, runs alternated; 64 clients each sending requests back to
   back (SSE and JSON). Final-message latency = the client reading `[DONE]` (or the JSON body)
   minus the time its last token was made, p50/p99; requests/s. Then the same pair with the
   real engine: output tokens/s at 64 streams.
Results: bench/results/service.json.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time

from common import (STORIES, alternated, free_port, log, machine_info, median, percentile, start_process,
                    stop_process, wait_http, write_result)

import aiohttp  # noqa: E402
import uvloop  # noqa: E402


def start_server(args: list[str], port: int, env: dict | None = None):
    """Start a server (this repo's interpreter) with its own data dir; return once /ready answers."""
    proc = start_process([sys.executable, *args, "--port", str(port)],
                         env={"PAGEDSERVE_SERVER_DATA_DIR": tempfile.mkdtemp(prefix="bench-service-"), **(env or {})})
    wait_http(f"http://127.0.0.1:{port}/ready", proc, timeout=120)
    return proc


DURABILITY_SYSTEMS = ("durable", "reply_first")  # server.reply_after_usage_on_disk = true / false


def data_dir_filesystem() -> str:
    """The filesystem type under tempfile's folder (fsync on tmpfs costs nothing: say so)."""
    import psutil

    folder = tempfile.gettempdir()
    best = max((p for p in psutil.disk_partitions(all=True) if folder.startswith(p.mountpoint)),
               key=lambda p: len(p.mountpoint), default=None)
    return f"{folder} on {best.fstype if best else 'unknown'}"


async def final_message_stub(session, url: str, stream: bool, num_tokens: int, latencies: list[float]) -> None:
    """One request; the gap between its last token being made and the client holding the answer's end."""
    body = {"model": "stub", "prompt": "x", "max_tokens": num_tokens, "stream": stream}
    last_stamp = None
    async with session.post(url + "/v1/completions", json=body) as response:
        if stream:
            async for line in response.content:
                for match in TEXT_FIELD.finditer(line):
                    if match.group(1).split():
                        last_stamp = int(match.group(1).split()[-1])
                if line.startswith(b"data: [DONE]"):
                    break
        else:
            raw = await response.read()
            last_stamp = int(TEXT_FIELD.search(raw).group(1).split()[-1])
        now_us = time.perf_counter_ns() // 1000
    if response.status != 200 or last_stamp is None:
        raise RuntimeError(f"bad answer: {response.status}")
    latencies.append((now_us - last_stamp) / 1e6)


async def durability_run(url: str, concurrency: int, requests_each: int, num_tokens: int) -> dict:
    latencies = {True: [], False: []}

    async def client(session, index: int) -> None:
        for turn in range(requests_each):
            stream = (index + turn) % 2 == 0
            await final_message_stub(session, url, stream, num_tokens, latencies[stream])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session, i) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    ms = lambda v: round(1e3 * v, 3)  # noqa: E731
    num_requests = concurrency * requests_each
    return {"requests": num_requests, "seconds": round(elapsed, 3), "requests_per_s": round(num_requests / elapsed, 1),
            "tokens_per_s": round(num_requests * num_tokens / elapsed),
            "sse_final_ms_p50": ms(percentile(latencies[True], 0.5)),
            "sse_final_ms_p99": ms(percentile(latencies[True], 0.99)),
            "json_final_ms_p50": ms(percentile(latencies[False], 0.5)),
            "json_final_ms_p99": ms(percentile(latencies[False], 0.99))}


def durability_stub(quick: bool) -> dict:
    """Stub servers with and without the wait, alternated; medians over the repeats and the deltas."""
    repeats, requests_each, num_tokens = (2, 10, 8) if quick else (5, 40, 16)
    ports = {name: free_port() for name in DURABILITY_SYSTEMS}
    procs = {}
    try:
        for name in DURABILITY_SYSTEMS:
            flags = ["--reply-before-usage-on-disk"] if name == "reply_first" else []
            procs[name] = start_server(["bench/stub_server.py", *flags], ports[name])
        runs: dict[str, list[dict]] = {name: [] for name in DURABILITY_SYSTEMS}
        for repeat, name in alternated(DURABILITY_SYSTEMS, repeats):
            log(f"durability (stub engine), repeat {repeat + 1}/{repeats}, {name}: 64 clients x {requests_each} ...")
            run = uvloop.run(durability_run(f"http://127.0.0.1:{ports[name]}", 64, requests_each, num_tokens))
            log(f"  {run}")
            runs[name].append(run)
    finally:
        for proc in procs.values():
            stop_process(proc)
    medians = {name: {key: median([r[key] for r in rs]) for key in rs[0]} for name, rs in runs.items()}
    durable, first = medians["durable"], medians["reply_first"]
    return {"concurrency": 64, "requests_each": requests_each, "tokens_each": num_tokens, "repeats": repeats,
            "data_dir": data_dir_filesystem(), "median": medians, "runs": runs,
            "added_ms": {key: round(durable[key] - first[key], 3) for key in durable if key.endswith(("p50", "p99"))},
            "requests_per_s_ratio": round(durable["requests_per_s"] / first["requests_per_s"], 3)}


def durability_real(quick: bool) -> dict:
    """Real-engine servers with and without the wait, alternated: output tokens/s at 64 streams."""
    repeats, max_tokens = (2, 32) if quick else (5, 128)
    ports = {name: free_port() for name in DURABILITY_SYSTEMS}
    procs = {}
    try:
        for name in DURABILITY_SYSTEMS:
            env = {"PAGEDSERVE_SERVER_REPLY_AFTER_USAGE_ON_DISK": "false" if name == "reply_first" else "true"}
            procs[name] = start_server(["-m", "service.cli", "serve", "--model", str(STORIES), "--max-num-seqs", "64"],
                                       ports[name], env)
        runs: dict[str, list[dict]] = {name: [] for name in DURABILITY_SYSTEMS}
        for repeat, name in alternated(DURABILITY_SYSTEMS, repeats):
            log(f"durability (real engine), repeat {repeat + 1}/{repeats}, {name}: 64 streams ...")
            run = uvloop.run(real_run(f"http://127.0.0.1:{ports[name]}", 64, max_tokens))
            log(f"  {run['output_tokens_per_s']} tok/s, last token -> [DONE] p50 {run['last_token_to_done_ms_p50']} "
                f"ms, p99 {run['last_token_to_done_ms_p99']} ms")
            runs[name].append(run)
    finally:
        for proc in procs.values():
            stop_process(proc)
    keys = ("output_tokens_per_s", "last_token_to_done_ms_p50", "last_token_to_done_ms_p99")
    medians = {name: {key: median([r[key] for r in rs]) for key in keys} for name, rs in runs.items()}
    durable, first = medians["durable"], medians["reply_first"]
    return {"concurrency": 64, "max_tokens": max_tokens, "repeats": repeats, "runs": runs, "median": medians,
            "added_ms": {key: round(durable[key] - first[key], 3) for key in keys[1:]},
            "ratio": round(durable["output_tokens_per_s"] / first["output_tokens_per_s"], 3)}


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
    done_at = None
    async with session.post(url + "/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {") and b'"text":""' not in line:
                chunk_times.append(time.perf_counter())
            elif line.startswith(b"data: [DONE]"):
                done_at = time.perf_counter()
    return {"ttft": chunk_times[0] - start, "gaps": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "end": chunk_times[-1], "final_gap": done_at - chunk_times[-1]}


async def real_run(url: str, concurrency: int, max_tokens: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_real(session, url, f"Story {i}: once there was", max_tokens)
                                         for i in range(concurrency)))
        elapsed = max(r["end"] for r in results) - start
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    final_gaps = [r["final_gap"] for r in results]
    ms = lambda v: round(1e3 * v, 2)  # noqa: E731
    return {"concurrency": concurrency, "max_tokens": max_tokens,
            "ttft_ms_p50": ms(percentile(ttfts, 0.5)), "ttft_ms_p99": ms(percentile(ttfts, 0.99)),
            "itl_ms_p50": ms(percentile(gaps, 0.5)), "itl_ms_p90": ms(percentile(gaps, 0.9)),
            "itl_ms_p99": ms(percentile(gaps, 0.99)),
            "last_token_to_done_ms_p50": ms(percentile(final_gaps, 0.5)),
            "last_token_to_done_ms_p99": ms(percentile(final_gaps, 0.99)),
            "output_tokens_per_s": round(concurrency * max_tokens / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only-durability", action="store_true", help="run part 3 alone (bench/results/durability.json)")
    args = parser.parse_args()
    result: dict = {"machine": machine_info()}
    if args.only_durability:
        result["durability_stub_engine"] = durability_stub(args.quick)
        result["durability_real_engine"] = durability_real(args.quick)
        log(f"stub: added {result['durability_stub_engine']['added_ms']}, requests/s ratio "
            f"{result['durability_stub_engine']['requests_per_s_ratio']}; real: added "
            f"{result['durability_real_engine']['added_ms']}, tok/s ratio {result['durability_real_engine']['ratio']}")
        write_result("durability", args.quick, result)
        return
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
    result["durability_stub_engine"] = durability_stub(args.quick)
    log(f"durability, stub engine: added {result['durability_stub_engine']['added_ms']}, requests/s ratio "
        f"{result['durability_stub_engine']['requests_per_s_ratio']}")
    result["durability_real_engine"] = durability_real(args.quick)
    log(f"durability, real engine: output tok/s ratio {result['durability_real_engine']['ratio']}")
    write_result("service", args.quick, result)


if __name__ == "__main__":
    main()
