"""Engine overhead: time in engine.step() outside the model, as a share of the step, at batch 1, 16, 64.

    .venv/bin/python bench/bench_overhead.py [--repeats 3] [--quick]

The model's part is timed by wrapping, in this process only, the runner's model
(`engine.runner.model.forward`, which includes attention through the page tables and the
K/V writes) and its `compute_logits` with perf_counter; the rest of `engine.step()` is the
engine's: scheduling, page allocation, building the flat inputs / slots / page tables,
sampling, stop checks, incremental detokenization, outputs. runtime/ is not edited.

Batch B requests (64-token random prompts, EOS ignored) are prefilled, then `DECODE_STEPS`
decode steps are timed (every step has B sequences). Repeated with a fresh engine, median
of the repeats; on stories260K (a tiny model: the worst case for overhead) and the ~20M
random Llama. Goal: under 10%. Results: bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import time

from common import (timed, STORIES, log, machine_info, make_prompts, median, pin_threads, quick_mode, random_llama_dir,
                    wait_for_quiet, write_result)

from runtime import Engine, SamplingParams  # noqa: E402

PROMPT_LEN = 64


def measure(model_dir, batch: int, decode_steps: int, seed: int) -> dict:
    engine = Engine.from_pretrained(model_dir, num_blocks=2048, max_num_seqs=max(64, batch),
                                    max_num_batched_tokens=4096, enable_prefix_caching=True)
    model_time = [0.0]
    model = engine.runner.model
    model.forward = timed(model.forward, model_time)  # instance attribute: nn.Module.__call__ finds it first
    model.compute_logits = timed(model.compute_logits, model_time)
    params = SamplingParams(max_tokens=decode_steps + 8, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(batch, PROMPT_LEN, PROMPT_LEN, seed=seed)):
        engine.add_request(f"o{i}", prompt, params)
    while engine.stats()["num_waiting"] or any(  # prefill until every sequence decodes
            s.num_tokens - s.num_computed_tokens > 1 for s in engine.scheduler.running):
        engine.step()
    step_time = 0.0
    model_time[0] = 0.0
    for _ in range(decode_steps):
        start = time.perf_counter()
        engine.step()
        step_time += time.perf_counter() - start
    if engine.stats()["num_running"] != batch:
        raise RuntimeError("a sequence finished during the timed steps")
    return {"step_ms": 1e3 * step_time / decode_steps, "model_ms": 1e3 * model_time[0] / decode_steps,
            "overhead_pct": 100 * (1 - model_time[0] / step_time)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    repeats = args.repeats or (1 if args.quick else 3)
    decode_steps = 8 if args.quick else 32
    pin_threads()
    rows = []
    llama20m, tmp = random_llama_dir()
    with tmp:
        for name, model_dir in (("stories260K", STORIES), ("random-llama-20M", llama20m)):
            measure(model_dir, 4, 4, seed=0)  # warm-up
            for batch in (1, 16, 64):
                runs = []
                for r in range(repeats):
                    background = wait_for_quiet()
                    runs.append(measure(model_dir, batch, decode_steps, seed=r) | {"background_cpu_pct": background})
                row = {"model": name, "batch": batch, "decode_steps": decode_steps,
                       "step_ms": round(median([x["step_ms"] for x in runs]), 3),
                       "model_ms": round(median([x["model_ms"] for x in runs]), 3),
                       "overhead_pct": round(median([x["overhead_pct"] for x in runs]), 1),
                       "runs": runs}
                row["overhead_ms"] = round(row["step_ms"] - row["model_ms"], 3)
                rows.append(row)
                log(f"{name} batch {batch}: step {row['step_ms']} ms, model {row['model_ms']} ms, "
                    f"outside the model {row['overhead_pct']}%")
    result = {"machine": machine_info(), "repeats": repeats, "prompt_tokens": PROMPT_LEN, "goal": "overhead < 10%",
              "rows": rows}
    write_result("overhead", args.quick, result)


if __name__ == "__main__":
    main()
