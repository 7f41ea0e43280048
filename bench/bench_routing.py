"""Three pagedserve workers behind Dynamo on this machine: KV-aware routing vs round robin vs random.

Many tenants x a few long system prompts, Poisson arrivals, streamed completions. For each
routing mode a fresh cluster (three `pagedserve worker`s, cold caches, and one front door
`pagedserve serve --router dynamo --routing MODE`) takes the same trace; modes alternate
(kv, round_robin, random, then reversed, ...). Reported per mode (median of repeats):
prefix hit rate (cached / prompt tokens, from each answer's usage), TTFT p50 / p99, output
tok/s over the run, and how the requests spread over the workers. `kv` is Dynamo's KV router
with its default cost (a block to prefill weighs as much as a block of decode load); `kv_x4`
the same router with prefill_load_scale 4 (distributed.kv_prefill_load_scale), which holds
a tenant's requests on the worker with its pages longer before spreading them.

The model is bench/common.py's ~20M random Llama (float32). Each worker runs torch on one
thread (OMP_NUM_THREADS=1): three workers share this machine's cores.

    .venv/bin/python bench/bench_routing.py [--quick] [--repeats 2] [--requests 240] [--rates 4 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import common
from common import log, machine_info, median, percentile, start_process, stop_process, wait_http, write_result

MODES = ("kv", "kv_x4", "round_robin", "random")  # kv_x4: Dynamo's KV router with prefill_load_scale 4
PREFILL_LOAD_SCALE = {"kv": 1.0, "kv_x4": 4.0}
NUM_WORKERS = 3
TENANTS = 8
PROMPTS_PER_TENANT = 2
SYSTEM_TOKENS = 384  # 24 pages of 16
USER_TOKENS = 32
MAX_TOKENS = 16
NUM_BLOCKS = 160  # per worker: a third of the 16 system prompts fit (384 pages in all)


def make_trace(num_requests: int, rate: float, seed: int) -> list[dict]:
    """Arrival time, tenant and token-id prompt of every request (the same for every mode)."""
    rng = random.Random(seed)
    systems = {(t, p): [1] + [rng.randrange(3, 512) for _ in range(SYSTEM_TOKENS - 1)]
               for t in range(TENANTS) for p in range(PROMPTS_PER_TENANT)}
    trace, at = [], 0.0
    for i in range(num_requests):
        at += rng.expovariate(rate)
        tenant, prompt = rng.randrange(TENANTS), rng.randrange(PROMPTS_PER_TENANT)
        user = [rng.randrange(3, 512) for _ in range(USER_TOKENS)]
        trace.append({"at": at, "tenant": tenant, "prompt": systems[(tenant, prompt)] + user})
    return trace


def tenants_file(path: Path) -> Path:
    import hashlib

    lines = ['[plans.standard]', 'input_per_mtok = 0.5', 'cached_input_per_mtok = 0.05', 'output_per_mtok = 1.5', '']
    for t in range(TENANTS):
        digest = hashlib.sha256(f"sk-tenant-{t}".encode()).hexdigest()
        lines += [f"[tenants.t{t}]", f'keys_sha256 = ["{digest}"]', 'plan = "standard"', ""]
    path.write_text("\n".join(lines))
    return path


class Cluster:
    """Three workers and a front door with one routing mode, in a fresh folder."""

    def __init__(self, model: Path, mode: str, root: Path) -> None:
        python = str(common.REPO / ".venv" / "bin" / "python")
        env = {"OMP_NUM_THREADS": "1", "PAGEDSERVE_SERVER_CACHE_SALT_SECRET": "bench", "PAGEDSERVE_SERVER_LOG_LEVEL":
               "warning", "PAGEDSERVE_DISTRIBUTED_KV_PREFILL_LOAD_SCALE": str(PREFILL_LOAD_SCALE.get(mode, 1.0))}
        routing = "kv" if mode in PREFILL_LOAD_SCALE else mode
        discovery = root / "discovery"
        self.workers = []
        for i in range(NUM_WORKERS):
            port = common.free_port()
            proc = start_process([python, "-m", "service.cli", "worker", "--model", str(model), "--discovery-dir",
                                  str(discovery), "--port", str(port), "--num-blocks", str(NUM_BLOCKS),
                                  "--max-num-seqs", "16"], env=env, log_path=root / f"worker-{i}.log")
            self.workers.append((proc, f"http://127.0.0.1:{port}"))
        for i, (proc, url) in enumerate(self.workers):
            wait_http(url + "/ready", proc, log_path=root / f"worker-{i}.log")
        port = common.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.front = start_process([python, "-m", "service.cli", "serve", "--router", "dynamo", "--routing", routing,
                                    "--model", str(model), "--discovery-dir", str(discovery), "--port", str(port),
                                    "--data-dir", str(root / "data"), "--tenants", str(tenants_file(root / "t.toml"))],
                                   env=env, log_path=root / "front-door.log")
        wait_http(self.url + "/ready", self.front, log_path=root / "front-door.log")

    def worker_prompt_tokens(self) -> list[int]:
        """Prompt tokens each worker looked up in its prefix cache so far (one lookup per prompt at admission)."""
        import urllib.request

        counts = []
        for _, url in self.workers:
            with urllib.request.urlopen(url + "/stats", timeout=5) as response:
                stats = json.loads(response.read())
            counts.append(stats["prefix_cache_queries"])
        return counts

    def stop(self) -> None:
        stop_process(self.front)
        for proc, _ in self.workers:
            stop_process(proc)


async def _one(session, url: str, item: dict, start: float) -> dict:
    import aiohttp

    await asyncio.sleep(max(0.0, start + item["at"] - time.monotonic()))
    sent = time.monotonic()
    body = {"model": "llama-20m", "prompt": item["prompt"], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer sk-tenant-{item['tenant']}"}
    first, usage = None, None
    async with session.post(url + "/v1/completions", json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=300)) as response:
        if response.status != 200:
            return {"error": response.status}
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["text"] and first is None:
                first = time.monotonic()
            usage = event.get("usage") or usage
    return {"ttft": (first or time.monotonic()) - sent, "end": time.monotonic(), "sent": sent, **(usage or {})}


async def drive(url: str, trace: list[dict]) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        start = time.monotonic()
        return await asyncio.gather(*(_one(session, url, item, start) for item in trace))


def run_mode(model: Path, mode: str, trace: list[dict]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-routing-{mode}-") as tmp:
        cluster = Cluster(model, mode, Path(tmp))
        try:
            before = cluster.worker_prompt_tokens()
            answers = asyncio.run(drive(cluster.url, trace))
            spread = [b - a for a, b in zip(before, cluster.worker_prompt_tokens())]
        finally:
            cluster.stop()
    done = [a for a in answers if "error" not in a]
    prompt = sum(a["prompt_tokens"] for a in done)
    cached = sum(a["prompt_tokens_details"]["cached_tokens"] for a in done)
    ttfts = [a["ttft"] for a in done]
    elapsed = max(a["end"] for a in done) - min(a["sent"] for a in done)
    return {"hit_rate": cached / prompt, "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "output_tok_s": sum(a["completion_tokens"] for a in done) / elapsed, "errors": len(answers) - len(done),
            "elapsed_s": elapsed, "worker_share": [round(s / max(1, sum(spread)), 3) for s in spread]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0], help="arrivals per second (Poisson)")
    args = parser.parse_args()
    common.quick_mode(args.quick)
    if args.quick:
        args.repeats, args.requests = 1, 30
    model, handle = common.random_llama_dir()
    results = {}
    for rate in args.rates:
        trace = make_trace(args.requests, rate, seed=7)
        log(f"routing bench: {NUM_WORKERS} workers, {TENANTS} tenants x {PROMPTS_PER_TENANT} system prompts of "
            f"{SYSTEM_TOKENS} tokens, {args.requests} requests at {rate}/s, {args.repeats} repeats")
        runs = common.run_alternated({mode: (lambda m=mode: run_mode(model, m, trace)) for mode in MODES},
                                     args.repeats, f"routing @{rate}/s")
        summary = {mode: {key: median([r[key] for r in rs]) for key in ("hit_rate", "ttft_p50_s", "ttft_p99_s",
                                                                         "output_tok_s", "errors")}
                   for mode, rs in runs.items()}
        for mode in MODES:
            m = summary[mode]
            log(f"{rate}/s {mode:12s} hit {m['hit_rate']:.1%}  TTFT p50 {m['ttft_p50_s'] * 1000:.0f} ms  "
                f"p99 {m['ttft_p99_s'] * 1000:.0f} ms  {m['output_tok_s']:.1f} tok/s")
        ratios = {mode: {"output_tok_s": summary["kv"]["output_tok_s"] / summary[mode]["output_tok_s"],
                         "ttft_p50": summary["kv"]["ttft_p50_s"] / summary[mode]["ttft_p50_s"],
                         "ttft_p99": summary["kv"]["ttft_p99_s"] / summary[mode]["ttft_p99_s"]}
                  for mode in MODES[1:]}
        results[str(rate)] = {"summary": summary, "kv_over": ratios, "runs": runs}
    write_result("routing", args.quick, {
        "machine": machine_info(), "workload": {"workers": NUM_WORKERS, "tenants": TENANTS,
                                                "prompts_per_tenant": PROMPTS_PER_TENANT,
                                                "system_tokens": SYSTEM_TOKENS, "user_tokens": USER_TOKENS,
                                                "max_tokens": MAX_TOKENS, "num_blocks_per_worker": NUM_BLOCKS,
                                                "requests": args.requests, "rates": args.rates, "model": "llama-20m",
                                                "worker_torch_threads": 1},
        "by_rate": results})
    del handle


if __name__ == "__main__":
    main()
