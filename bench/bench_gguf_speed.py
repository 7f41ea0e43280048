"""Ours against llama-server on the same GGUF files: one stream (TPOT, output tok/s) and 16 streams (tok/s).

    .venv/bin/python bench/bench_gguf_speed.py [--files NAME...] [--repeats N] [--quick]

Files (bench/gguf_files.py makes them with llama.cpp's own tools): SmolLM2-135M in Q4_0, Q4_K_M and
Q8_0; random-weight Qwen3-0.6B, Llama-3.2-1B and Gemma-3-1B shapes in Q4_K_M. For each file both
servers start once (`pagedserve serve --model FILE`, quantization auto; `llama-server -m FILE`, 16
slots, 2 threads), then the loads run alternated (ours, llama.cpp, then llama.cpp, ours, ...):

- stream1:  4 requests one after another, a 64-token prompt, 128 tokens out (EOS ignored): TTFT,
            TPOT (the gaps between streamed tokens after the first), output tok/s of the wall time;
- stream16: 32 requests 16 at a time, 96-token prompts, 64 out: output tok/s of the wall time.

Memory: each server's resident memory (VmRSS of its process tree) once it has answered the
warm-up, against the file's size; ours holds KV_CACHE_BYTES of pages besides (allocated at start),
so its ratio is (RSS - KV pages) / file size (the issue's goal: <= 1.2 at 1B Q4_K_M).

The client is this script's own (aiohttp, /v1/completions streamed, prompts as token ids drawn
from the vocabulary with a fixed seed, the same for both). Results: bench/results/gguf_speed.json,
with this machine's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from pathlib import Path

from common import alternated, free_port, log, machine_info, median, start_process, stop_process, wait_http, \
    write_result

from gguf_files import gguf_path, llama_cpp_tools

FILES = ("smollm2-Q4_0", "smollm2-Q4_K_M", "smollm2-Q8_0", "qwen3-0.6b-Q4_K_M", "llama3.2-1b-Q4_K_M",
         "gemma3-1b-Q4_K_M")
LOADS = {"stream1": dict(requests=4, concurrency=1, prompt=64, out=128),
         "stream16": dict(requests=32, concurrency=16, prompt=96, out=64)}
SYSTEMS = ("pagedserve", "llama.cpp")
KV_CACHE_BYTES = 1 << 30
VOCAB_FLOOR = 1000  # prompt ids from [VOCAB_FLOOR, 32000): ordinary tokens in every vocabulary here


def tree_rss_mib(pid: int) -> float:
    """Resident memory (VmRSS) of a process and its descendants, in MiB."""
    import psutil

    total = 0
    for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return round(total / 2**20, 1)


def start(system: str, path: Path, root: Path) -> tuple:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logfile = root / f"{system}-{path.stem}.log"
    if system == "pagedserve":
        proc = start_process([sys.executable, "-m", "service.cli", "serve", "--model", str(path), "--port", str(port),
                              "--served-model-name", "m", "--max-num-seqs", "32"],
                             env={"PAGEDSERVE_SERVER_DATA_DIR": str(root / f"data-{path.stem}"),
                                  "PAGEDSERVE_SERVER_LOG_LEVEL": "warning",
                                  "PAGEDSERVE_ENGINE_KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES)}, log_path=logfile)
        wait_http(url + "/ready", proc, timeout=600, log_path=logfile)
    else:
        proc = start_process([str(llama_cpp_tools() / "llama-server"), "-m", str(path), "--host", "127.0.0.1",
                              "--port", str(port), "--alias", "m", "-np", "16", "-c", str(16 * 1024), "-t", "2",
                              "--no-webui"], log_path=logfile)
        wait_http(url + "/health", proc, timeout=600, log_path=logfile)
    return proc, url


async def one_request(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sent = time.perf_counter()
    times = []
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):  # a token's chunk, even one whose text is empty (llama.cpp's control tokens:
                times.append(time.perf_counter())  # random-weight models emit the converter's [PAD] tokens)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft_s": times[0] - sent, "tpot_s": sum(gaps) / len(gaps) if gaps else 0.0, "chunks": len(times)}


async def run_load(url: str, load: dict, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB_FLOOR, 32000) for _ in range(load["prompt"])] for _ in range(load["requests"])]
    limit = asyncio.Semaphore(load["concurrency"])
    # a connection per request: llama-server closes kept-alive connections between requests, which a reused
    # connection meets as "Can not write request body"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        async def bounded(prompt):
            async with limit:
                return await one_request(session, url, prompt, load["out"])

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - started
    return {"wall_s": wall, "output_tok_s": load["requests"] * load["out"] / wall,
            "ttft_ms_p50": 1000 * median([r["ttft_s"] for r in results]),
            "tpot_ms_p50": 1000 * median([r["tpot_s"] for r in results])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import tempfile

    result = {"machine": machine_info(), "loads": LOADS, "files": {}}
    root = Path(tempfile.mkdtemp(prefix="gguf-speed-"))  # the servers' logs: kept when a run fails
    log(f"server logs in {root}")
    if True:
        for name in args.files:
            path = gguf_path(name)
            servers = {system: start(system, path, root) for system in SYSTEMS}
            runs: dict = {system: {load: [] for load in LOADS} for system in SYSTEMS}
            try:
                memory = {}
                for system, (proc, url) in servers.items():  # warm-up: first touch of the weights, kernels' first calls
                    asyncio.run(run_load(url, dict(requests=1, concurrency=1, prompt=16, out=8), 99))
                    memory[system] = tree_rss_mib(proc.pid)
                size_mib = path.stat().st_size / 2**20
                memory["ours_rss_less_kv_over_file"] = (memory["pagedserve"] - KV_CACHE_BYTES / 2**20) / size_mib
                log(f"{name}: RSS ours {memory['pagedserve']} MiB (less KV pages: x{memory['ours_rss_less_kv_over_file']:.2f} "
                    f"the file), llama.cpp {memory['llama.cpp']} MiB; file {size_mib:.1f} MiB")
                for load_name, load in LOADS.items():
                    for repeat, system in alternated(SYSTEMS, 1 if args.quick else args.repeats):
                        measured = asyncio.run(run_load(servers[system][1], load, seed=repeat))
                        runs[system][load_name].append(measured)
                        log(f"{name} {load_name} {system}: {measured['output_tok_s']:.1f} tok/s, "
                            f"TPOT {measured['tpot_ms_p50']:.2f} ms, TTFT {measured['ttft_ms_p50']:.1f} ms")
            finally:
                for proc, _ in servers.values():
                    stop_process(proc)
            summary = {}
            for load_name in LOADS:
                ours = {k: median([r[k] for r in runs["pagedserve"][load_name]]) for k in runs["pagedserve"][load_name][0]}
                peer = {k: median([r[k] for r in runs["llama.cpp"][load_name]]) for k in runs["llama.cpp"][load_name][0]}
                summary[load_name] = {"pagedserve": ours, "llama.cpp": peer,
                                      "tok_s_ratio": ours["output_tok_s"] / peer["output_tok_s"],
                                      "tpot_ratio": ours["tpot_ms_p50"] / peer["tpot_ms_p50"]}
            result["files"][name] = {"size_mib": round(path.stat().st_size / 2**20, 1), "memory_mib": memory,
                                     "runs": runs, "summary": summary}
            write_result("gguf_speed", args.quick, result)  # after each file: a cut-short run keeps what it measured
    shutil.rmtree(root, ignore_errors=True)
    for name, entry in result["files"].items():
        for load_name, s in entry["summary"].items():
            print(f"{name:22s} {load_name:8s} ours {s['pagedserve']['output_tok_s']:7.1f} tok/s "
                  f"TPOT {s['pagedserve']['tpot_ms_p50']:6.2f} ms | llama.cpp {s['llama.cpp']['output_tok_s']:7.1f} "
                  f"tok/s TPOT {s['llama.cpp']['tpot_ms_p50']:6.2f} ms | x{s['tok_s_ratio']:.2f} tok/s")


if __name__ == "__main__":
    main()
