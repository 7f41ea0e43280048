"""Seeded sampling in two source trees: the same tokens? (a sampler refactor must not change a seeded answer)

    git worktree add /tmp/base <commit>
    .venv/bin/python bench/seeded_ab.py /tmp/base . [--model smollm2] [--max-tokens 24]

Each tree, in its own process, generates 45 seeded requests in one batch: 5 prompts under 9 settings
(temperature alone, top_p, top_k, min_p, top_k + top_p + min_p, the three penalties, greedy with a
repetition penalty, greedy, top_p with n = 3). Reported: how many requests' token lists are equal.
Results: bench/results/seeded_ab[_smollm2].json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import STORIES, log, machine_info, write_result
from smollm2 import gguf_file

SETTINGS = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20),
            dict(temperature=1.2, min_p=0.05), dict(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
            dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
            dict(temperature=0, repetition_penalty=1.5), dict(temperature=0), dict(temperature=1.0, top_p=0.5, n=3)]
PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day, a bird", "The sun was"]

CHILD = r"""
import json, sys
tree, path, max_tokens, settings, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), \
    json.loads(sys.argv[5])
sys.path[:0] = [tree]
from runtime import Engine, SamplingParams
engine = Engine.from_pretrained(path, num_blocks=1024, max_num_seqs=16)
params, texts = [], []
for i, setting in enumerate(settings):
    for j, prompt in enumerate(prompts):
        params.append(SamplingParams(max_tokens=max_tokens, seed=i * 10 + j, **setting))
        texts.append(prompt)
print(json.dumps([[o.token_ids for o in out.outputs] for out in engine.generate(texts, params)]))
"""


def run(tree: Path, model_path: Path, max_tokens: int) -> list:
    command = [sys.executable, "-c", CHILD, str(tree), str(model_path), str(max_tokens), json.dumps(SETTINGS),
               json.dumps(PROMPTS)]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--model", choices=("stories260K", "smollm2"), default="stories260K")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    model_path = STORIES if args.model == "stories260K" else gguf_file()  # one file for both trees
    outputs = {}
    for name, tree in (("base", args.base.resolve()), ("new", args.new.resolve())):
        log(f"{name}: {tree}")
        outputs[name] = run(tree, model_path, args.max_tokens)
    equal = [a == b for a, b in zip(outputs["base"], outputs["new"])]
    log(f"{sum(equal)} of {len(equal)} seeded requests give the same tokens")
    suffix = "" if args.model == "stories260K" else f"_{args.model}"
    write_result(f"seeded_ab{suffix}", False, {
        "machine": machine_info(), "model": args.model, "max_tokens": args.max_tokens, "settings": SETTINGS,
        "num_requests": len(equal), "num_equal": sum(equal),
        "unequal": [i for i, same in enumerate(equal) if not same]})


if __name__ == "__main__":
    main()
