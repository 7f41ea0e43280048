"""The engine's step in two source trees, side by side: a refactor's cost outside the model, measured.

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/step_ab.py /tmp/base . [--batches 1 16 64] [--rounds 3] [--model smollm2] [--sampled]

For each batch size, each tree runs in its own process (alternated, `--rounds` times): stories260K,
B requests of 64-token prompts prefilled, then 8 blocks of 25 greedy decode steps timed (the
minimum block's step time: the least disturbed by a busy machine; and its time outside
`runner.execute`: scheduling, sampling, stop checks, outputs), and 50 more steps under
cProfile for the Python function calls per step (deterministic: the same code makes the same calls,
whatever the machine's noise). Results: bench/results/step_ab[_smollm2][_sampled].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import log, machine_info, write_result

CHILD = r"""
import cProfile, json, pstats, sys, time
tree, batch, model, sampled = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "sampled"
sys.path[:0] = [tree, tree + "/bench"]
from common import STORIES, make_prompts
from runtime import Engine, SamplingParams
if model == "smollm2":
    from smollm2 import gguf_file
    model_dir = gguf_file()
else:
    model_dir = STORIES
engine = Engine.from_pretrained(model_dir, num_blocks=4096, max_num_seqs=max(64, batch), max_num_batched_tokens=4096)
# 64 + 400 within stories260K's 512 positions; sampled: the knobs chat clients send, each row its own seed
knobs = dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1) if sampled else dict(temperature=0)
for i, prompt in enumerate(make_prompts(batch, 64, 64, seed=1)):
    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=400, ignore_eos=True, seed=i, **knobs))
for _ in range(4):
    engine.step()
runner_seconds = [0.0]
execute = engine.runner.execute
def timed_execute(batch):
    started = time.perf_counter()
    try:
        return execute(batch)
    finally:
        runner_seconds[0] += time.perf_counter() - started
engine.runner.execute = timed_execute
blocks, outside = [], []
for _ in range(8):
    runner_seconds[0] = 0.0
    started = time.perf_counter()
    for _ in range(25):
        engine.step()
    elapsed = time.perf_counter() - started
    blocks.append(elapsed / 25 * 1000)
    outside.append((elapsed - runner_seconds[0]) / 25 * 1000)
profile = cProfile.Profile()
profile.enable()
for _ in range(50):
    engine.step()
profile.disable()
print(json.dumps({"step_ms_min": min(blocks), "outside_ms_min": min(outside),
                  "calls_per_step": pstats.Stats(profile).total_calls / 50}))
"""


def run(tree: Path, batch: int, model: str, sampled: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(batch), model, "sampled" if sampled else "greedy"],
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=("stories260K", "smollm2"), default="stories260K",
                        help="smollm2: SmolLM2-135M-Instruct's Q4_1 GGUF (bench/smollm2.py): 49,152-token rows to sample")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.8, top_p 0.9, top_k 50, "
                        "repetition_penalty 1.1, a seed per request (default: greedy)")
    args = parser.parse_args()
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    rows = []
    for batch in args.batches:
        runs: dict[str, list[dict]] = {"base": [], "new": []}
        for round_index in range(args.rounds):
            order = ("base", "new") if round_index % 2 == 0 else ("new", "base")
            for name in order:
                runs[name].append(run(trees[name], batch, args.model, args.sampled))
                log(f"batch {batch} round {round_index + 1}/{args.rounds} {name}: {runs[name][-1]}")
        row = {"batch": batch}
        for name, results in runs.items():
            row[name] = {"step_ms_min": round(min(r["step_ms_min"] for r in results), 3),
                         "step_ms_median": round(statistics.median(r["step_ms_min"] for r in results), 3),
                         "outside_ms_min": round(min(r["outside_ms_min"] for r in results), 3),
                         "outside_ms_median": round(statistics.median(r["outside_ms_min"] for r in results), 3),
                         "calls_per_step": results[0]["calls_per_step"]}
        row["calls_ratio"] = round(row["new"]["calls_per_step"] / row["base"]["calls_per_step"], 4)
        log(f"batch {batch}: calls per step {row['base']['calls_per_step']} -> {row['new']['calls_per_step']}, "
            f"min step {row['base']['step_ms_min']} -> {row['new']['step_ms_min']} ms, outside the runner (median "
            f"of rounds' minima) {row['base']['outside_ms_median']} -> {row['new']['outside_ms_median']} ms")
        rows.append(row)
    name = "step_ab" + ("" if args.model == "stories260K" else f"_{args.model}") + ("_sampled" if args.sampled else "")
    write_result(name, False, {"machine": machine_info(), "trees": {k: str(v) for k, v in trees.items()},
                               "model": args.model, "sampled": args.sampled, "rows": rows})


if __name__ == "__main__":
    main()
