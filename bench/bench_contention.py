"""Decode steps with a co-running process on the same cores: what a benchmark client costs the engine.

    .venv/bin/python bench/bench_contention.py [--quick] [--repeats N] [--duty 0.3]

`vllm bench serve` runs on the machine it measures. This shows the effect on its own: the
23M random Llama of the vLLM comparison (float32, 2 torch threads), 44 sequences with
160-token prompts decoding, and the median decode step timed with and without a spinner
process that keeps one core busy `duty` of the time (bursts of 2 ms), alternated, median of
the repeats; then the same with torch on one thread.

Part 2, what a server's threads cost (16 sequences, 2 torch threads, no spinner): the engine
built and stepped on one thread, against built on one thread and stepped on another (what
the server did before service/bridge/engine_thread.py's EngineThread), each in a fresh process,
alternated. Results: bench/results/contention.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (
    alternated,
    log,
    machine_info,
    make_prompts,
    make_random_llama,
    median,
    pin_threads,
    quick_mode,
    write_result,
)

from runtime import Engine, SamplingParams

NUM_SEQS = 44
SPINNER = """
import sys, time
duty = float(sys.argv[1])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < duty * 0.002:
        pass
    time.sleep((1 - duty) * 0.002)
"""


THREADS_PART = """
import sys, threading
sys.path[:0] = sys.argv[3:]
from pathlib import Path
import bench_contention
model, case = Path(sys.argv[1]), sys.argv[2]
engine = None if case == "one_thread" else bench_contention.build_engine(model)
result = []
worker = threading.Thread(target=lambda: result.append(bench_contention.decode_step_ms(model, 40, 16, engine)))
worker.start()
worker.join()
print(result[0])
"""


def build_engine(model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, max_num_seqs=128, max_num_batched_tokens=4096)


def decode_step_ms(model_dir: Path, steps: int, num_seqs: int = NUM_SEQS, engine: Engine | None = None) -> float:
    """Median decode step of `num_seqs` sequences, after their prefill (the engine built here unless given)."""
    engine = engine or build_engine(model_dir)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(num_seqs, 160, 160, seed=0)):
        engine.add_request(f"c{i}", prompt, params)
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1000)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--duty", type=float, default=0.3)
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    repeats = args.repeats or (1 if args.quick else 3)
    steps = 10 if args.quick else 40
    tmp = tempfile.TemporaryDirectory(prefix="bench-contention-")
    model = make_random_llama(Path(tmp.name) / "llama-23m", num_layers=8, num_kv_heads=2)
    results = {}
    for threads in (2, 1):
        torch.set_num_threads(threads)
        runs: dict[str, list[float]] = {"alone": [], "spinner": []}
        for _, case in alternated(list(runs), repeats):
            spinner = subprocess.Popen([sys.executable, "-c", SPINNER, str(args.duty)]) if case == "spinner" else None
            try:
                runs[case].append(decode_step_ms(model, steps))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            log(f"{threads} thread(s), {case}: {runs[case][-1]:.1f} ms per decode step")
        alone, spun = median(runs["alone"]), median(runs["spinner"])
        results[f"{threads}_threads"] = {"alone_ms": round(alone, 2), "spinner_ms": round(spun, 2),
                                         "slowdown": round(spun / alone, 3), "runs_ms": runs}
        log(f"{threads} thread(s): {alone:.1f} ms alone, {spun:.1f} ms beside the spinner (x{spun / alone:.2f})")
    threads: dict[str, list[float]] = {"one_thread": [], "built_elsewhere": []}
    here = str(Path(__file__).resolve().parent)
    for _, case in alternated(list(threads), repeats):
        out = subprocess.run([sys.executable, "-c", THREADS_PART, str(model), case, here, str(Path(here).parent)],
                             check=True, capture_output=True, text=True).stdout
        threads[case].append(float(out.strip().splitlines()[-1]))
        log(f"16 sequences, engine {case.replace('_', ' ')}: {threads[case][-1]:.1f} ms per decode step")
    one, elsewhere = median(threads["one_thread"]), median(threads["built_elsewhere"])
    results["server_threads"] = {"num_seqs": 16, "one_thread_ms": round(one, 2), "built_elsewhere_ms": round(elsewhere, 2),
                                 "slowdown": round(elsewhere / one, 3), "runs_ms": threads}
    log(f"engine stepped where it was built: {one:.1f} ms; built on another thread: {elsewhere:.1f} ms "
        f"(x{elsewhere / one:.2f})")
    path = write_result("contention", args.quick, {"machine": machine_info(), "num_seqs": NUM_SEQS,
                                                   "spinner_duty": args.duty, "repeats": repeats, "results": results})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
