"""Where a served output token's time goes: py-spy on the server under a serving load.

    .venv/bin/python bench/profile_server.py [--quick] [--model llama-23m|smollm2]

The server (`pagedserve serve`) runs the 23M random Llama of the vLLM comparison (hidden
512, 8 layers, 8 query / 2 KV heads, head_dim 64, vocab 512, stories260K's tokenizer),
float32, or with `--model smollm2` SmolLM2-135M-Instruct (bench/smollm2.py). The load is
issue 10's: 96 streaming /v1/completions requests, prompts of 128 +- 64 random token ids,
64 output tokens each (ignore_eos), Poisson arrivals at 16 req/s (SmolLM2: 32 requests at
2 req/s, what it serves without a queue here).

Two py-spy recorders sample the server at once, non-blocking, every thread:
- `--idle`: every thread at every sample, waiting or not (wall time per thread);
- `--gil`: only the thread holding the GIL at each sample.
Each sample of the first is put in one category by the innermost frame a rule knows
(see CATEGORIES); the categories' seconds, divided by the output tokens served while
recording, give milliseconds per output token. The second says how much of the wall time
each thread held the GIL, and how often nobody did.

Then torch's profiler on decode steps of the same model in this process (64 sequences of
128-token prompts, 10 steps after a warm-up): the operators' self CPU time per step, and the
share of the step spent outside the model runner (scheduling, sampling, outputs).

Results: bench/results/profile_server[_smollm2].json (and the table on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from common import free_port, log, machine_info, pin_threads, start_process, stop_process, wait_http, write_result

from bench_vllm import MODELS, benchmark_model

import aiohttp  # noqa: E402

RATE_HZ = 200  # py-spy samples per second

# (category, thread, substrings of "Class.function (file:line)" frames; the innermost frame a rule knows wins)
CATEGORIES = [
    ("engine: attention (paged gather + SDPA)", "engine", ["(kernels/", "(runtime/attention.py"]),
    ("engine: model (matmuls, norms, rope)", "engine", ["(runtime/model/"]),
    ("engine: prepare inputs (runner)", "engine", ["(runtime/model_runner.py"]),
    ("engine: schedule + pages", "engine", ["(runtime/scheduler.py", "(runtime/kv_cache_manager.py",
                                           "(runtime/block_pool.py", "(runtime/block_hash.py"]),
    ("engine: sample", "engine", ["(runtime/sampler.py"]),
    ("engine: stop checks + detokenize", "engine", ["(runtime/detokenizer.py", "Engine._append_token"]),
    ("engine: outputs + stats", "engine", ["Engine._make_output", "Engine.stats", "Engine.take_kv_events",
                                          "Engine._num_kv_tokens"]),
    ("engine: add requests", "engine", ["Engine.add ", "Engine.add_request"]),
    ("engine: bridge (inbox, hand-off)", "engine", ["(service/bridge/"]),
    ("loop: deliver to streams", "loop", ["EngineBridge._deliver", "(service/streams.py"]),
    ("loop: format + encode (SSE/JSON)", "loop", ["(service/api/formatting.py", "(msgspec"]),
    ("loop: request parsing + validation", "loop", ["(service/api/protocol.py", "RequestBuilder.prepare_request",
                                                    "Engine.tokenize", "(service/tenants.py", "(runtime/"]),
    ("loop: billing + metrics", "loop", ["(service/billing/", "(service/metrics.py", "Generation.finish"]),
    ("loop: HTTP and writes (aiohttp)", "loop", ["(aiohttp/"]),
    ("loop: handlers (other service code)", "loop", ["(service/"]),
]
ENGINE_WAITS = {  # leaf frame -> why the engine thread is not working
    "EngineBridge._drain (service/bridge/engine_bridge.py": "engine: idle, waiting for requests",
    "Semaphore.acquire (threading.py": "engine: waiting for the loop to take its outputs (backpressure)",
}
LOOP_IDLE = ["Runner.run (asyncio/runners.py"]  # uvloop's C loop: polling sockets, or its own C work
THREADS = {"engine": "engine", "MainThread": "loop", "usage-journal-writer": "journal"}


MODEL_NAME = "bench-model"  # the name the server answers to, whichever model


def requests_for_load(num: int, seed: int, vocab_size: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        length = rng.randint(64, 192)
        out.append({"model": MODEL_NAME, "prompt": [1] + [rng.randrange(3, vocab_size) for _ in range(length - 1)],
                    "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}})
    return out


async def one(session, url: str, body: dict, delay: float, t0: float) -> int:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {") and b'"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens


async def load(url: str, bodies: list[dict], rate: float, seed: int) -> tuple[int, float]:
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in bodies:
        t += rng.expovariate(rate)
        delays.append(t)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(session, url, b, d, t0) for b, d in zip(bodies, delays)))
    return sum(counts), time.perf_counter() - t0


def parse_raw(path: Path) -> list[tuple[str, list[str], int]]:
    """py-spy --format raw with --threads: (thread frame, frames outermost first, count) per line."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        stacks.append((frames[0], frames[1:], int(count)))
    return stacks


def thread_kind(thread: str) -> str:
    """"thread (25057): engine" -> "engine"; the main thread runs the event loop."""
    return THREADS.get(thread.partition(": ")[2], "other")


def categorize(kind: str, frames: list[str]) -> str:
    leaf = frames[-1] if frames else ""
    for marker, name in ENGINE_WAITS.items():
        if kind == "engine" and marker in leaf:
            return name
    if kind == "loop" and any(marker in leaf for marker in LOOP_IDLE):
        return "loop: in uvloop's C code (polling sockets, its own callbacks)"
    for frame in reversed(frames):
        for name, thread, markers in CATEGORIES:
            if thread == kind and any(marker in frame for marker in markers):
                return name
    return f"{kind}: other"


def profile_steps(model: Path, vocab_size: int, num_seqs: int = 64, num_steps: int = 10) -> dict:
    """torch.profiler over `num_steps` decode steps of `num_seqs` sequences: self CPU ms per step, by operator.

    Then as many unprofiled steps, timing the model runner's part of each (`outside_runner_share`:
    what scheduling, sampling and outputs add to a step).
    """
    from torch.profiler import ProfilerActivity, profile

    from runtime import Engine, SamplingParams

    pin_threads()
    engine = Engine.from_pretrained(model, num_blocks=2048, max_num_seqs=128, max_num_batched_tokens=8192)
    rng = random.Random(3)
    for i in range(num_seqs):
        prompt = [1] + [rng.randrange(3, vocab_size) for _ in range(127)]
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for _ in range(4):  # prefill, then warm decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        step_ms = 1e3 * (time.perf_counter() - start) / num_steps
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    ops = {e.key: round(e.self_cpu_time_total / 1e3 / num_steps, 3) for e in rows[:15]}
    runner_s = []
    execute = engine.runner.execute

    def timed(*args):
        t = time.perf_counter()
        out = execute(*args)
        runner_s.append(time.perf_counter() - t)
        return out

    engine.runner.execute = timed
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    total = time.perf_counter() - start
    return {"num_seqs": num_seqs, "context": 128, "num_steps": num_steps, "step_ms_profiled": round(step_ms, 3),
            "self_cpu_ms_per_step": ops, "step_ms": round(1e3 * total / num_steps, 3),
            "outside_runner_share": round(1 - sum(runner_s) / total, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="llama-23m", choices=MODELS)
    args = parser.parse_args()
    real = args.model == "smollm2"
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        raise SystemExit("py-spy is not installed: .venv/bin/pip install py-spy (it is in the dev extra)")
    num = (16 if args.quick else 32) if real else (32 if args.quick else 96)
    rate = 2.0 if real else 16.0
    tmp = tempfile.TemporaryDirectory(prefix="profile-server-")
    root = Path(tmp.name)
    model = benchmark_model(args.model, root)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    port = free_port()
    proc = start_process([sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--port", str(port),
                          "--max-num-seqs", "128", "--num-blocks", "2048", "--served-model-name", MODEL_NAME],
                         env={"PAGEDSERVE_SERVER_DATA_DIR": str(root / "data"), "PAGEDSERVE_SERVER_LOG_LEVEL": "warning",
                              "PAGEDSERVE_SERVER_MAX_QUEUED_REQUESTS": "4096"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, timeout=120)
        log("warm-up: 8 requests")
        asyncio.run(load(url, requests_for_load(8, 1, vocab_size), 100.0, 1))
        bodies = requests_for_load(num, 7, vocab_size)
        duration = 60 if args.quick else 120
        recorders = {}
        for mode in ("idle", "gil"):
            out = root / f"{mode}.txt"
            recorders[mode] = (out, subprocess.Popen(
                [py_spy, "record", "--pid", str(proc.pid), "--threads", "--nonblocking", "--format", "raw",
                 "--rate", str(RATE_HZ), "--duration", str(duration), "--output", str(out), f"--{mode}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
        log(f"load: {num} requests at {rate:g} req/s, 64 output tokens each, py-spy recording")
        tokens, seconds = asyncio.run(load(url, bodies, rate, 7))
        log(f"  {tokens} output tokens in {seconds:.1f} s ({tokens / seconds:.0f} tok/s); stopping the recorders")
        for out, recorder in recorders.values():
            recorder.send_signal(2)  # SIGINT: py-spy writes what it has
            recorder.wait(60)
    finally:
        stop_process(proc)
    for mode, (out, _) in recorders.items():
        shutil.copy(out, Path(tempfile.gettempdir()) / f"profile_server_{mode}.txt")
    wall = parse_raw(recorders["idle"][0])
    gil = parse_raw(recorders["gil"][0])
    per_thread_samples: Counter = Counter()
    categories: Counter = Counter()
    for thread, frames, count in wall:
        kind = thread_kind(thread)
        per_thread_samples[kind] += count
        if kind in ("engine", "loop"):  # the journal writer and the worker threads only wait here
            categories[categorize(kind, frames)] += count
    num_ticks = max(per_thread_samples["engine"], per_thread_samples["loop"], 1)  # each live thread once a tick
    gil_by_thread: Counter = Counter()
    for thread, _, count in gil:
        gil_by_thread[thread_kind(thread)] += count
    recorded_s = num_ticks / RATE_HZ
    ms_per_token = 1e3 * recorded_s / max(tokens, 1)
    table = defaultdict(dict)
    for name, count in sorted(categories.items(), key=lambda kv: (kv[0].split(":")[0], -kv[1])):
        share = count / num_ticks
        table[name] = {"share_of_wall": round(share, 4), "ms_per_output_token": round(share * ms_per_token, 4)}
    gil_share = {kind: round(count / num_ticks, 4) for kind, count in gil_by_thread.items()}
    gil_share["nobody"] = round(max(0.0, 1 - sum(gil_by_thread.values()) / num_ticks), 4)
    model_label = "SmolLM2-135M-Instruct" if real else "random Llama 23M (8 layers, 512)"
    result = {"machine": machine_info(), "load": {"requests": num, "rate": rate, "prompt_len": "64-192",
                                                  "max_tokens": 64, "model": model_label},
              "output_tokens": tokens, "load_seconds": round(seconds, 2), "recorded_seconds": round(recorded_s, 2),
              "ms_per_output_token_wall": round(ms_per_token, 4), "sample_rate_hz": RATE_HZ,
              "categories": table, "gil_held_share": gil_share}
    log("torch profiler: 64 sequences x 10 decode steps, in this process")
    result["decode_step_ops"] = profile_steps(model, vocab_size)
    write_result("profile_server" + ("_smollm2" if real else ""), args.quick, result)
    for name, row in table.items():
        log(f"{name:55s} {100 * row['share_of_wall']:5.1f}% of wall  {row['ms_per_output_token']:.3f} ms/token")
    log(f"GIL held: {gil_share}")
    steps = result["decode_step_ops"]
    log(f"decode step, 64 sequences: {steps['step_ms_profiled']} ms (under the profiler), {steps['step_ms']} ms "
        f"without; {100 * steps['outside_runner_share']:.1f}% of it outside the model runner")
    for op, ms in steps["self_cpu_ms_per_step"].items():
        log(f"  {op:40s} {ms:8.3f} ms/step")


if __name__ == "__main__":
    main()
