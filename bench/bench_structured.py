"""Structured outputs: what a constrained batch costs per step, and what compiling a schema adds to the first token.

    .venv/bin/python bench/bench_structured.py [--quick]

Two vocabularies, each on a ~20M random Llama (hidden 512, 7 layers): stories260K's 512
tokens (the model the vLLM comparisons use) and Qwen2's 151,936 (rebuilt from llama.cpp's
vocab GGUF by bench/gguf_tokenizer.py, where the mask is as wide as a real model's).

Step time: 32 sequences decoding together in one Engine, every row constrained (each a
different schema of the battery, wrapped in an array of 64 so that no row ends while
measured) vs none (EOS ignored) vs half; the median of `STEPS` engine.step() calls once all
32 are decoding, arms alternated over repeats. The grammar's share is timed inside the step
(the sampler's `_allowed_ids`: each row's bitmask filled by llguidance, then its allowed ids
read by kernels/token_mask.py); advancing the matchers by the sampled tokens is in the step.

First token: a real `pagedserve serve`, sequential streamed chat requests, the time to the
first SSE event: no constraint vs a schema the server has never seen (compiled on the
request's path) vs one compiled before (a cache hit); arms alternated. The very first
constrained request after start is reported on its own (the server indexes the vocabulary
at start-up, so it should not pay for that).

Results: bench/results/structured.json (and _quick).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import requests

from common import (REPO, free_port, log, machine_info, make_random_llama, median, median_of, pin_threads,
                    quick_mode, run_alternated, start_process, stop_process, wait_http, write_result)
from gguf_tokenizer import qwen2_tokenizer_dir

from runtime import Engine, SamplingParams  # noqa: E402
from runtime.structured_outputs import StructuredOutputs  # noqa: E402
from tests.structured.schema_battery import SCHEMAS  # noqa: E402

BATCH = 32
PROMPT_LEN = 64


def _long_schema(i: int) -> dict:
    """Schema i of the battery, 64 times in an array: a constrained row that outlasts the measurement."""
    schema = dict(list(SCHEMAS.values())[i % len(SCHEMAS)])
    defs = schema.pop("$defs", None)  # references point at the root: keep the definitions there
    return {"type": "array", "items": schema, "minItems": 64, "maxItems": 64, **({"$defs": defs} if defs else {})}


def step_times(engine: Engine, arm: str, steps: int, seed: int) -> dict:
    """Median engine.step() seconds with BATCH decoding rows; the mask's share of it."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for i in range(BATCH):
        constrained = arm == "all" or (arm == "half" and i % 2 == 0)
        spec = StructuredOutputs(json=_long_schema(i)) if constrained else None
        params = SamplingParams(temperature=1.0, seed=seed * 100 + i, max_tokens=900, ignore_eos=True,
                                structured_outputs=spec)
        engine.add_request(f"{arm}-{seed}-{i}", [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)], params)
    sampler = engine.sampler
    real_allowed, mask_s = sampler._allowed_ids, [0.0]

    def timed_allowed(*args):
        start = time.perf_counter()
        allowed = real_allowed(*args)
        mask_s[0] += time.perf_counter() - start
        return allowed

    sampler._allowed_ids = timed_allowed
    try:
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
                engine.scheduler.waiting:
            engine.step()  # prefill (not measured)
        engine.step()
        times, masks = [], []
        for _ in range(steps):
            mask_s[0] = 0.0
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            masks.append(mask_s[0])
        if len(engine.scheduler.running) != BATCH:
            raise RuntimeError(f"{len(engine.scheduler.running)} rows decoding, not {BATCH}: a row ended early")
    finally:
        del sampler._allowed_ids
        for request_id in engine.unfinished_request_ids():
            engine.abort_request(request_id)
        engine.step()
    return {"step_ms": 1e3 * median(times), "mask_ms": 1e3 * median(masks)}


def measure_steps(model_dir: Path, repeats: int, steps: int) -> dict:
    engine = Engine.from_pretrained(model_dir, dtype="float32", num_blocks=BATCH * 16, max_num_seqs=BATCH)
    step_times(engine, "all", 4, seed=999)  # warm-up: grammar index, allocations
    seeds = iter(range(10_000))
    runs = run_alternated({arm: (lambda arm=arm: step_times(engine, arm, steps, next(seeds)))
                           for arm in ("none", "all", "half")}, repeats, f"steps {model_dir.name}")
    none, full, half = (median_of(runs[a], "step_ms") for a in ("none", "all", "half"))
    return {"runs": runs, "step_ms_none": none, "step_ms_all": full, "step_ms_half": half,
            "mask_ms_all": median_of(runs["all"], "mask_ms"), "overhead_all": full / none - 1,
            "overhead_half": half / none - 1}


def _first_event_s(url: str, body: dict) -> float:
    start = time.perf_counter()
    with requests.post(url, json=body, stream=True, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no event in the stream")


def measure_first_token(model_dir: Path, repeats: int, per_run: int) -> dict:
    port = free_port()
    data = tempfile.mkdtemp(prefix="bench-structured-")
    log_path = Path(data) / "server.log"
    proc = start_process([str(REPO / ".venv" / "bin" / "pagedserve"), "serve", "--model", str(model_dir),
                          "--port", str(port), "--data-dir", data, "--num-blocks", "512"], log_path=log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, log_path=log_path)
        chat = url + "/v1/chat/completions"
        base = {"model": model_dir.name, "messages": [{"role": "user", "content": "Describe a city."}],
                "max_tokens": 4, "temperature": 0, "stream": True}

        def with_schema(schema: dict) -> dict:
            return {**base, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}

        _first_event_s(chat, base)  # warm the unconstrained path
        first_ever = _first_event_s(chat, with_schema(SCHEMAS["several_fields"]))
        counter = iter(range(100_000))

        def unseen() -> dict:  # a battery schema with a key no earlier request used
            i = next(counter)
            schema = json.loads(json.dumps(list(SCHEMAS.values())[i % len(SCHEMAS)]))
            schema.setdefault("properties", {})[f"k{i}"] = {"type": "boolean"}
            return schema

        def arm(make) -> dict:
            return {"first_event_ms": 1e3 * median([_first_event_s(chat, make()) for _ in range(per_run)])}

        runs = run_alternated({"none": lambda: arm(lambda: base),
                               "cold_schema": lambda: arm(lambda: with_schema(unseen())),
                               "cached_schema": lambda: arm(lambda: with_schema(SCHEMAS["several_fields"]))},
                              repeats, f"first token {model_dir.name}")
    finally:
        stop_process(proc)
    none, cold, cached = (median_of(runs[a], "first_event_ms") for a in ("none", "cold_schema", "cached_schema"))
    return {"runs": runs, "first_ever_constrained_ms": 1e3 * first_ever, "first_event_ms_none": none,
            "first_event_ms_cold": cold, "first_event_ms_cached": cached,
            "added_ms_cold": cold - none, "added_ms_cached": cached - none}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and steps (a smoke run)")
    args = parser.parse_args()
    quick_mode(args.quick)
    pin_threads()
    repeats, steps, per_run = (2, 8, 3) if args.quick else (7, 96, 10)
    tmp = tempfile.TemporaryDirectory(prefix="bench-structured-models-")
    models = {"stories-vocab": make_random_llama(Path(tmp.name) / "llama20m-stories-vocab")}
    try:
        qwen_tokenizer = qwen2_tokenizer_dir()
        models["qwen2-vocab"] = make_random_llama(Path(tmp.name) / "llama20m-qwen2-vocab", tokenizer_dir=qwen_tokenizer)
    except FileNotFoundError as exc:
        log(f"skipping the Qwen2 vocabulary: {exc}")
    result = {"machine": machine_info(), "batch": BATCH, "prompt_len": PROMPT_LEN, "steps": steps,
              "repeats": repeats, "models": {}}
    for name, model_dir in models.items():
        log(f"{name}: step time, {BATCH} rows")
        entry = {"steps": measure_steps(model_dir, repeats, steps)}
        log(f"{name}: first token through the server")
        entry["first_token"] = measure_first_token(model_dir, repeats, per_run)
        result["models"][name] = entry
        s, f = entry["steps"], entry["first_token"]
        log(f"{name}: step {s['step_ms_none']:.2f} ms none, {s['step_ms_all']:.2f} all (+{100 * s['overhead_all']:.1f}%, "
            f"mask {s['mask_ms_all']:.2f} ms), {s['step_ms_half']:.2f} half; first event {f['first_event_ms_none']:.1f} "
            f"ms none, {f['first_event_ms_cold']:.1f} cold, {f['first_event_ms_cached']:.1f} cached, first ever "
            f"{f['first_ever_constrained_ms']:.0f}")
    print(write_result("structured", args.quick, result))


if __name__ == "__main__":
    main()
