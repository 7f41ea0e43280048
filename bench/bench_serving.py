"""Online serving against Hugging Face's own OpenAI-compatible server, at several request rates.

    .venv/bin/python bench/bench_serving.py [--repeats 3] [--quick]

Two servers run side by side on stories260K (float32, CPU, torch's default of one thread
per core in each): `pagedserve serve` and `transformers serve --continuous-batching`, both
with 16-token pages, the same KV token budget and a 1024-token step budget. This process is
the client: requests arrive as a Poisson process (fixed seed) at each rate, `inf` meaning
all at once, each a streaming `/v1/completions` (SSE) with its own prompt and output length
(greedy, EOS ignored, so every request makes exactly `max_tokens` tokens), the same list for
both servers. The servers take turns (A B, B A, A B) at each rate; each number is the
median over the repeats.

Metrics as vLLM's `bench serve` defines them: TTFT (send -> first token), TPOT ((end - first
token) / (output tokens - 1), per request), ITL (gap between successive token chunks, all
requests pooled), end-to-end latency; mean, p50, p90, p99 of each; request throughput and
output-token throughput (over first send -> last response). Output tokens are the servers'
own `usage.completion_tokens`.

Results: bench/results/serving.json, plot serving_latency.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from pathlib import Path

from common import (STORIES, free_port, log, machine_info, median, percentile, pyplot, quick_mode, save_figure,
                    start_process, stop_process, wait_for_quiet, wait_http, write_result)

import aiohttp  # noqa: E402

KV_TOKENS = 16384
BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 1024
MAX_NUM_SEQS = 128
CONTEXT = 512  # stories260K
MEAN_INPUT, MEAN_OUTPUT, SIGMA = 64, 96, 0.8
MAX_INPUT, MAX_OUTPUT = 200, 256
SEED = 0
WORDS = ("once upon a time there was a little girl named lily she liked to play in the park with her dog "
         "one day they found a big red ball under a tree and the sun was warm tom said we can share it "
         "mom smiled because the cat was happy to see the bird fly over the garden").split()


# --- workload ---------------------------------------------------------------------------


def make_requests(num: int, seed: int) -> list[dict]:
    """Prompts of story words with log-normal token lengths, log-normal output lengths (prompt + output < 512)."""
    from runtime.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(STORIES)
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        target = min(MAX_INPUT, max(4, round(rng.lognormvariate(math.log(MEAN_INPUT) - SIGMA**2 / 2, SIGMA))))
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS))
        prompt = " ".join(words).capitalize()
        num_prompt = len(tokenizer.encode(prompt))
        num_output = round(rng.lognormvariate(math.log(MEAN_OUTPUT) - SIGMA**2 / 2, SIGMA))
        num_output = max(4, min(MAX_OUTPUT, num_output))
        requests.append({"prompt": prompt, "num_prompt": num_prompt, "max_tokens": num_output})
    return requests


def rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def arrival_times(num: int, rate: float, seed: int) -> list[float]:
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# --- servers ----------------------------------------------------------------------------


class Server:
    """One server process: how to start it and how its request bodies look."""

    def __init__(self, name: str, argv: list[str], env: dict, ready_path: str, model_field: str, extra: dict) -> None:
        self.name, self.argv, self.env, self.ready_path = name, argv, env, ready_path
        self.model_field, self.extra = model_field, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkdtemp(prefix=f"bench-{name}-")) / "server.log"
        self.proc = None
        self.error: str | None = None

    def start(self) -> None:
        self.proc = start_process([*self.argv, "--port", str(self.port)], self.env, self.log_path)
        wait_http(self.url + self.ready_path, self.proc, timeout=180, log_path=self.log_path)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def body(self, request: dict) -> dict:
        return {"model": self.model_field, "prompt": request["prompt"], "max_tokens": request["max_tokens"],
                "stream": True, "temperature": 0, **self.extra}

    def idle_cpu_pct(self) -> float:
        """CPU use of the server process tree over 2 s with no requests (does its loop spin when idle?)."""
        import psutil

        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        for p in procs:
            p.cpu_percent()
        time.sleep(2)
        return round(sum(p.cpu_percent() for p in procs), 1)


def make_servers(data_dir: str) -> list[Server]:
    import sys

    ours = Server(
        "pagedserve",
        [sys.executable, "-m", "service.cli", "serve", "--model", str(STORIES), "--num-blocks",
         str(KV_TOKENS // BLOCK_SIZE), "--max-num-seqs", str(MAX_NUM_SEQS)],
        {"PAGEDSERVE_SERVER_DATA_DIR": data_dir, "PAGEDSERVE_ENGINE_BLOCK_SIZE": str(BLOCK_SIZE),
         "PAGEDSERVE_ENGINE_MAX_NUM_BATCHED_TOKENS": str(MAX_BATCHED_TOKENS),
         "PAGEDSERVE_SERVER_MAX_QUEUED_REQUESTS": "4096"},
        "/ready", "stories260K", {"ignore_eos": True, "stream_options": {"include_usage": True}},
    )
    cli = str(Path(sys.executable).with_name("transformers"))
    hf = Server(
        "hf-serve",
        [cli, "serve", "--continuous-batching", "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1",
         "--cb-block-size", str(BLOCK_SIZE), "--cb-num-blocks", str(KV_TOKENS // BLOCK_SIZE),
         "--cb-max-batch-tokens", str(MAX_BATCHED_TOKENS), str(STORIES)],
        {"HF_HUB_OFFLINE": "1"},
        "/health", str(STORIES),  # transformers serve names a local model by its path
        {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})},  # its way to ignore EOS
    )
    return [ours, hf]


# --- the client -------------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, server: Server, request: dict, delay: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    sent = time.perf_counter()
    chunks: list[float] = []
    usage = None
    error = None
    try:
        async with session.post(server.url + "/v1/completions", json=server.body(request)) as response:
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.text())[:200]}", "sent": sent}
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                data = json.loads(line[6:])
                if "error" in data:
                    error = str(data["error"])[:200]
                    break
                if data.get("choices") and data["choices"][0].get("text"):
                    chunks.append(now)
                if data.get("usage"):
                    usage = data["usage"]
    except aiohttp.ClientError as exc:
        error = repr(exc)
    end = time.perf_counter()
    if error or not chunks:
        return {"error": error or "no tokens", "sent": sent}
    return {"sent": sent, "first": chunks[0], "end": end, "chunks": chunks,
            "output_tokens": usage["completion_tokens"] if usage else len(chunks),
            "prompt_tokens": usage["prompt_tokens"] if usage else None}


async def run_load(server: Server, requests: list[dict], rate: float, seed: int) -> dict:
    delays = arrival_times(len(requests), rate, seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_request(session, server, r, d, t0) for r, d in zip(requests, delays)))
    return summarize_load(results, requests)


def summarize_load(results: list[dict], requests: list[dict]) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["first"] - r["sent"] for r in ok]
    e2e = [r["end"] - r["sent"] for r in ok]
    tpot = [(r["end"] - r["first"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    duration = max(r["end"] for r in ok) - min(r["sent"] for r in results) if ok else float("nan")
    output_tokens = sum(r["output_tokens"] for r in ok)
    expected = sum(q["max_tokens"] for q, r in zip(requests, results) if "error" not in r)
    out = {"completed": len(ok), "errors": len(errors), "duration_s": duration,
           "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
           "output_tokens": output_tokens, "output_tokens_expected": expected,
           "mean_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok) / max(1, len(ok))}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[f"{name}_mean_ms"] = 1e3 * sum(values) / len(values) if values else float("nan")
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = 1e3 * percentile(values, q / 100)
    if errors:
        out["first_error"] = errors[0]
    return out


# --- main -------------------------------------------------------------------------------


def plot(result: dict, quick: bool) -> None:
    from matplotlib.ticker import FuncFormatter

    plt = pyplot()
    metrics = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end latency")]
    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    labels = [str(r) if r == "inf" else f"{r:g}" for r in result["rates"]]
    xs = list(range(len(labels)))
    colors = {"pagedserve": "tab:blue", "hf-serve": "tab:orange"}
    for ax, (key, title) in zip(axes.flat, metrics):
        for name, per_rate in result["servers"].items():
            for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                ys = [row.get(f"{key}_{q}_ms", float("nan")) for row in per_rate]
                ax.plot(xs, ys, style, marker="o", markersize=3, label=f"{name} {q}", color=colors.get(name))
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(title)
    for ax, (key, title) in zip(axes.flat[4:], (("request_throughput", "requests/s"),
                                                ("output_throughput", "output tokens/s"))):
        for name, per_rate in result["servers"].items():
            ax.plot(xs, [row[key] for row in per_rate], marker="o", label=name, color=colors.get(name))
        ax.set_ylabel(title)
        ax.set_title(f"achieved {title}")
        ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("offered request rate (req/s)")
    axes.flat[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Serving vs request rate: pagedserve and transformers serve, stories260K on CPU (median of repeats)")
    save_figure(fig, "serving_latency", quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    repeats = args.repeats or (1 if args.quick else 3)
    rates = [4.0, math.inf] if args.quick else [2.0, 4.0, 8.0, 16.0, math.inf]
    num_requests = 12 if args.quick else 40
    requests = make_requests(num_requests, SEED)
    log(f"{num_requests} requests: mean prompt {sum(r['num_prompt'] for r in requests) / num_requests:.1f} tokens, "
        f"mean output {sum(r['max_tokens'] for r in requests) / num_requests:.1f} tokens; rates {rates}")
    data_dir = tempfile.mkdtemp(prefix="bench-serving-data-")
    servers = make_servers(data_dir)
    started: list[Server] = []
    try:
        for server in servers:
            log(f"starting {server.name} on :{server.port}")
            try:
                server.start()
                asyncio.run(run_load(server, make_requests(4, SEED + 1), math.inf, 0))  # warm-up (and HF's CB init)
                started.append(server)
                log(f"{server.name} ready; idle CPU {server.idle_cpu_pct()}%")
            except Exception as exc:  # noqa: BLE001 - the reason goes into the results
                server.error = f"{type(exc).__name__}: {exc}"
                log(f"{server.name} could not run: {server.error}")
                server.stop()
        runs: dict[str, dict[float, list[dict]]] = {s.name: {rate: [] for rate in rates} for s in started}
        plan = [(rep, rate, s) for rep in range(repeats) for rate in rates
                for s in (started if (rep + rates.index(rate)) % 2 == 0 else started[::-1])]
        for i, (rep, rate, server) in enumerate(plan, 1):
            background = wait_for_quiet()
            run = asyncio.run(run_load(server, requests, rate, SEED + rep))
            run["background_cpu_pct"] = background
            runs[server.name][rate].append(run)
            log(f"[{i}/{len(plan)}] {server.name} rate {rate:g} repeat {rep + 1}: "
                f"{run['completed']} ok, {run['errors']} errors, {run['output_throughput']:.0f} tok/s, "
                f"TTFT p50 {run['ttft_p50_ms']:.0f} ms, TPOT p50 {run['tpot_p50_ms']:.1f} ms, "
                f"E2E p99 {run['e2e_p99_ms']:.0f} ms")
    finally:
        for server in servers:
            server.stop()
    result = {
        "machine": machine_info(),
        "model": "stories260K",
        "repeats": repeats,
        "rates": [rate_label(r) for r in rates],
        "num_requests_per_run": num_requests,
        "workload": {"mean_prompt_tokens": round(sum(r["num_prompt"] for r in requests) / num_requests, 1),
                     "mean_output_tokens": round(sum(r["max_tokens"] for r in requests) / num_requests, 1),
                     "max_output_tokens": max(r["max_tokens"] for r in requests),
                     "distribution": f"log-normal prompt (mean {MEAN_INPUT}, cap {MAX_INPUT}) and output (mean "
                                     f"{MEAN_OUTPUT}, cap {MAX_OUTPUT}) tokens, sigma {SIGMA}; seed {SEED}"},
        "config": {"kv_tokens": KV_TOKENS, "block_size": BLOCK_SIZE, "max_batched_tokens": MAX_BATCHED_TOKENS,
                   "pagedserve_max_num_seqs": MAX_NUM_SEQS},
        "commands": {s.name: " ".join([*s.argv[1:], "--port", "N"]) for s in servers},
        "servers": {},
        "errors": {s.name: s.error for s in servers if s.error},
    }
    for name, per_rate in runs.items():
        result["servers"][name] = []
        for rate in rates:
            rows = per_rate[rate]
            merged = {"rate": rate_label(rate)}
            for key in rows[0]:
                if isinstance(rows[0][key], (int, float)):
                    merged[key] = round(median([row[key] for row in rows]), 3)
            merged["errors"] = sum(row["errors"] for row in rows)
            if any("first_error" in row for row in rows):
                merged["first_error"] = next(row["first_error"] for row in rows if "first_error" in row)
            result["servers"][name].append(merged)
    if len(runs) == 2:
        ours, hf = result["servers"]["pagedserve"], result["servers"]["hf-serve"]
        result["ratios_pagedserve_over_hf"] = [  # < 1 is better for latencies, > 1 for throughput
            {"rate": a["rate"],
             "output_throughput": round(a["output_throughput"] / b["output_throughput"], 2),
             "ttft_p50": round(a["ttft_p50_ms"] / b["ttft_p50_ms"], 3),
             "tpot_p50": round(a["tpot_p50_ms"] / b["tpot_p50_ms"], 3),
             "e2e_p99": round(a["e2e_p99_ms"] / b["e2e_p99_ms"], 3)} for a, b in zip(ours, hf)]
    write_result("serving", args.quick, result)
    plot(result, args.quick)


if __name__ == "__main__":
    main()
