"""Fair scheduling as the service runs it: a light tenant's first token while another floods, fcfs vs fair.

    .venv/bin/python bench/bench_fair_service.py [--quick] [--repeats N] [--regimes admission,engine]

Real `pagedserve serve` processes on a ~20M random Llama (bench/common.py's), one per policy
(`engine.scheduling` fcfs and fair), started side by side and measured in alternation. Tenant A
sends FLOOD_REQUESTS streamed completions at once (FLOOD_PROMPT prompt tokens, FLOOD_OUTPUT
output tokens, ignore_eos); tenant B sends one streamed completion a second (LIGHT_PROMPT
prompt, LIGHT_OUTPUT output) while the flood lasts. A runs in a process of its own, so reading
its 200 streams never delays B's client. Each policy is also measured with B alone.

Four regimes:
- admission: engine.max_num_seqs 64 and server.max_queued_requests 0: the flood fills the seats and
             its overflow waits at the front door (service/admission.py), which lets B in below its share;
- queue:     64 seats and the default queue of 256: the overflow waits in the engine's queue, where
             the scheduler's policy orders it;
- engine:    256 seats, more than the flood has requests: nothing waits for a seat, the step decides;
- dynamo:    the queue regime behind Dynamo: one `pagedserve worker` (the policy is its engine's) and a
             front door `pagedserve serve --router dynamo` in front of it. The trace is the embedded
             server's, so --trace leaves this regime out.

Reported per regime and policy (medians of the repeats): B's TTFT p50 / p99 under the flood and
alone, the flood's output tokens per second, and the goals' ratios (B's TTFT p99 fair / fcfs
<= 1; fair under the flood / fair alone <= 2; the flood's tok/s fair / fcfs >= 0.95). With
--trace, every request's server-side trace (bench/trace_requests.py) is kept too.
Results: bench/results/fair_service.json; BENCHMARKS.md section "Fair scheduling through the server".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
from common import (REPO, alternated, free_port, log, machine_info, make_random_llama, median, percentile, quick_mode,
                    start_process, stop_process, wait_for_quiet, wait_http, write_result)

from trace_requests import read_traces, summarize

from tests.service.conftest import write_tenants_file  # noqa: E402

KEY_A, KEY_B = "sk-flood-a", "sk-light-b"
FLOOD_REQUESTS, FLOOD_PROMPT, FLOOD_OUTPUT = 200, 512, 128
LIGHT_PROMPT, LIGHT_OUTPUT, LIGHT_EVERY_S = 64, 32, 1.0
ALONE_REQUESTS = 12
# engine.max_num_seqs, server.max_queued_requests, the router ("dynamo": a worker behind a front door)
REGIMES = {"admission": (64, 0, "embedded"), "queue": (64, 256, "embedded"), "engine": (256, 0, "embedded"),
           "dynamo": (64, 256, "dynamo")}
POLICIES = ("fcfs", "fair")  # also "fair:N": fair with engine.fair_prompt_tokens_per_step N (fair:0, no cap)
VOCAB_LOW, VOCAB_HIGH = 3, 500  # token ids drawn for the prompts (stories260K's tokenizer: 512)


def _prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


async def _stream(session: aiohttp.ClientSession, url: str, key: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: seconds to its first token, to its end, and tokens received."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status != 200:
            raise RuntimeError(f"{key} got {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
    return {"ttft_s": first, "total_s": time.perf_counter() - start, "tokens": tokens,
            "request_id": response.headers.get("x-request-id")}


async def _flood(url: str, seed: int, num_requests: int) -> dict:
    rng = random.Random(seed)
    prompts = [_prompt(FLOOD_PROMPT, rng) for _ in range(num_requests)]
    connector = aiohttp.TCPConnector(limit=num_requests)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(session, url, KEY_A, p, FLOOD_OUTPUT) for p in prompts))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "ttft_p50_s": median([r["ttft_s"] for r in results])}


def _flood_process(url: str, seed: int, num_requests: int, results: multiprocessing.Queue) -> None:
    results.put(asyncio.run(_flood(url, seed, num_requests)))


async def _light(url: str, seed: int, until: multiprocessing.Event | None, count: int) -> list[dict]:
    """B's requests, one every LIGHT_EVERY_S, each on its own task: until `until` is set (the flood ended), or
    `count` of them."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        while (until is not None and not until.is_set()) or (until is None and len(tasks) < count):
            tasks.append(asyncio.ensure_future(_stream(session, url, KEY_B, _prompt(LIGHT_PROMPT, rng), LIGHT_OUTPUT)))
            await asyncio.sleep(LIGHT_EVERY_S)
        return list(await asyncio.gather(*tasks))


def _run(url: str, with_flood: bool, seed: int, flood_requests: int) -> dict:
    """One run: B alone, or B while A floods (prompts drawn from `seed`: no run hits another's cached prefix)."""
    if not with_flood:
        light = asyncio.run(_light(url, seed, None, ALONE_REQUESTS))
        ttfts = [r["ttft_s"] for r in light]
        return {"b_ttft_p50_s": median(ttfts), "b_ttft_p99_s": percentile(ttfts, 0.99), "b_requests": len(light),
                "b": light}
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    flood = context.Process(target=_flood_process, args=(url, seed, flood_requests, results))
    ended = context.Event()
    flood.start()
    time.sleep(1.0)  # the flood's requests are in before B's first

    def watch() -> None:
        flood.join()
        ended.set()

    threading.Thread(target=watch, daemon=True).start()
    light = asyncio.run(_light(url, seed + 1, ended, 0))
    outcome = results.get(timeout=60)
    ttfts = [r["ttft_s"] for r in light]
    return {"b_ttft_p50_s": median(ttfts), "b_ttft_p99_s": percentile(ttfts, 0.99), "b_requests": len(light),
            "flood": outcome, "b": light}


def _start(model_dir: Path, folder: Path, policy: str, regime: tuple[int, int, str], trace: bool) -> tuple:
    """The regime's processes for one policy (a server, or a Dynamo worker and its front door) and the URL."""
    folder.mkdir(parents=True)
    tenants = write_tenants_file(folder / "tenants.toml", {"a": {"keys": [KEY_A], "plan": "standard"},
                                                           "b": {"keys": [KEY_B], "plan": "standard"}})
    max_num_seqs, max_queued, router = regime
    scheduling, _, cap = policy.partition(":")
    env = {"PAGEDSERVE_ENGINE_SCHEDULING": scheduling, "PAGEDSERVE_ENGINE_MAX_NUM_SEQS": str(max_num_seqs),
           **({"PAGEDSERVE_ENGINE_FAIR_PROMPT_TOKENS_PER_STEP": cap} if cap else {}),  # else the default (256)
           "PAGEDSERVE_SERVER_MAX_QUEUED_REQUESTS": str(max_queued),
           "PAGEDSERVE_SERVER_ADMISSION_WAIT_S": "900",  # the flood's overflow waits its turn, it is not refused
           "PAGEDSERVE_SERVER_SERVED_MODEL_NAME": "bench", "PAGEDSERVE_SERVER_TRACE_REQUESTS": "1" if trace else "0"}
    python = str(REPO / ".venv" / "bin" / "python")
    procs = []
    serve = [python, "-m", "service.cli", "serve", "--model", str(model_dir), "--data-dir", str(folder),
             "--tenants", str(tenants)]
    if router == "dynamo":
        discovery = folder / "discovery"
        port = free_port()
        worker = start_process([python, "-m", "service.cli", "worker", "--model", str(model_dir), "--discovery-dir",
                                str(discovery), "--port", str(port)], env=env, log_path=folder / "worker.log")
        procs.append(worker)
        wait_http(f"http://127.0.0.1:{port}/ready", worker, timeout=300, log_path=folder / "worker.log")
        serve += ["--router", "dynamo", "--discovery-dir", str(discovery)]
    port = free_port()
    procs.append(start_process(serve + ["--port", str(port)], env=env, log_path=folder / "server.log"))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", procs[-1], timeout=300, log_path=folder / "server.log")
    return procs, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--trace", action="store_true", help="keep every request's server-side trace")
    parser.add_argument("--flood-requests", type=int, default=FLOOD_REQUESTS)
    parser.add_argument("--policies", default=",".join(POLICIES), help="fcfs, fair, and fair:N variants")
    args = parser.parse_args()
    quick_mode(args.quick)
    regimes = [r for r in args.regimes.split(",") if r]
    if set(regimes) - set(REGIMES):
        parser.error(f"regimes are {', '.join(REGIMES)}")
    repeats = 1 if args.quick else args.repeats
    flood_requests = args.flood_requests
    policies = [p for p in args.policies.split(",") if p]
    if "fcfs" not in policies or "fair" not in policies:
        parser.error("--policies must name fcfs and fair (the goals compare them); fair:N may be added")
    runs: dict = {r: {p: {"flood": [], "alone": []} for p in policies} for r in regimes}
    with tempfile.TemporaryDirectory(prefix="fair-service-") as tmp:
        folder = Path(tmp)
        model_dir = make_random_llama(folder / "llama")
        for regime in regimes:
            servers = {}
            try:
                for policy in policies:
                    servers[policy] = _start(model_dir, folder / f"{regime}-{policy}", policy, REGIMES[regime],
                                             args.trace)
                    log(f"{regime}: {policy} server at {servers[policy][1]}")
                for r, policy in alternated(policies, repeats):
                    for with_flood in ((True, False) if r % 2 == 0 else (False, True)):
                        background = wait_for_quiet()
                        server_log = folder / f"{regime}-{policy}" / "server.log"
                        log_start = server_log.stat().st_size
                        result = _run(servers[policy][1], with_flood, 1000 * r + 10 * with_flood, flood_requests)
                        result["background_cpu_pct"] = background
                        if args.trace and REGIMES[regime][2] == "embedded":
                            time.sleep(0.5)  # the last lines reach the file
                            result["trace"] = summarize(read_traces(server_log, log_start))
                            log(f"  trace of B: {json.dumps(result['trace'].get('b'))}")
                        runs[regime][policy]["flood" if with_flood else "alone"].append(result)
                        flood = result.get("flood")
                        log(f"{regime} {policy} {'flood' if with_flood else 'alone'} repeat {r + 1}/{repeats}: "
                            f"B's TTFT p50 {result['b_ttft_p50_s'] * 1e3:.0f} ms p99 {result['b_ttft_p99_s'] * 1e3:.0f} ms"
                            f" ({result['b_requests']} requests)"
                            + (f", flood {flood['output_tok_s']:.0f} tok/s in {flood['wall_s']:.1f} s" if flood else ""))
            finally:
                for procs, _ in servers.values():
                    for proc in reversed(procs):
                        stop_process(proc)
    summary = {}
    for regime in regimes:
        row = {}
        for policy in policies:
            flood, alone = runs[regime][policy]["flood"], runs[regime][policy]["alone"]
            row[policy] = {"b_ttft_p99_flood_s": median([x["b_ttft_p99_s"] for x in flood]),
                           "b_ttft_p50_flood_s": median([x["b_ttft_p50_s"] for x in flood]),
                           "b_ttft_p99_alone_s": median([x["b_ttft_p99_s"] for x in alone]),
                           "flood_tok_s": median([x["flood"]["output_tok_s"] for x in flood])}
        row["fair_over_fcfs_b_ttft_p99"] = row["fair"]["b_ttft_p99_flood_s"] / row["fcfs"]["b_ttft_p99_flood_s"]
        row["fair_flood_over_alone_b_ttft_p99"] = row["fair"]["b_ttft_p99_flood_s"] / row["fair"]["b_ttft_p99_alone_s"]
        row["fair_over_fcfs_flood_tok_s"] = row["fair"]["flood_tok_s"] / row["fcfs"]["flood_tok_s"]
        summary[regime] = row
        log(f"{regime}: {json.dumps(row)}")
    name = "fair_service" if policies == list(POLICIES) and regimes == list(REGIMES) else \
        "fair_service_" + "_".join([*regimes, *(p.replace(":", "") for p in policies)])
    path = write_result(name, args.quick, {
        "machine": machine_info(), "repeats": repeats, "policies": policies,
        "load": {"flood_requests": flood_requests, "flood_prompt": FLOOD_PROMPT, "flood_output": FLOOD_OUTPUT,
                 "light_prompt": LIGHT_PROMPT, "light_output": LIGHT_OUTPUT, "light_every_s": LIGHT_EVERY_S},
        "regimes": {r: {"max_num_seqs": REGIMES[r][0], "max_queued_requests": REGIMES[r][1], "router": REGIMES[r][2]}
                    for r in regimes},
        "goals": {"fair_over_fcfs_b_ttft_p99": 1.0, "fair_flood_over_alone_b_ttft_p99": 2.0,
                  "fair_over_fcfs_flood_tok_s": 0.95},
        "summary": summary, "runs": runs})
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
