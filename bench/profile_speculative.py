"""Where a speculative step's time goes: the `prediction` rewrite load on SmolLM2, one stream.

    .venv/bin/python bench/profile_speculative.py [--dtype float32]

The engine (SmolLM2's Q4_1 GGUF, no method) runs bench_speculative's rewrite prompts twice
alone: without drafts, and with each request's original text as its `prediction`. Each
step's phases are timed (propose, schedule, the runner's forward, applying the results:
sampling or verification, stop checks, outputs), then torch's profiler takes the operators
of 20 steps of each kind. Per step and per output token, the phases show what a verified
row costs against a plain decode. Results: bench/results/profile_speculative.json.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from common import log, machine_info, pin_threads, write_result

from bench_speculative import TEXTS, chat, rewrite_prompt  # noqa: E402
from runtime import Engine, SamplingParams  # noqa: E402
from smollm2 import gguf_file  # noqa: E402

PHASES = (("propose", "speculator", "propose"), ("schedule", "scheduler", "schedule"), ("forward", "runner", "execute"))


def timed(engine: Engine, prompts, predictions) -> dict:
    """Run each prompt alone; seconds per phase, steps, output tokens, rows computed."""
    seconds: dict[str, float] = defaultdict(float)
    rows = [0]  # tokens computed (prompt chunks, decodes, verified drafts)
    originals = []
    for name, owner, method in PHASES:
        target = getattr(engine, owner)
        original = getattr(target, method)
        originals.append((target, method, original))

        def wrapped(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - start

        setattr(target, method, wrapped)
    apply = engine._apply

    def timed_apply(batch, logits):
        start = time.perf_counter()
        try:
            return apply(batch, logits)
        finally:
            seconds["apply"] += time.perf_counter() - start
            rows[0] += batch.num_tokens

    engine._apply = timed_apply
    steps = tokens = 0
    start = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=160, temperature=0),
                               prediction=predictions[i] if predictions else None)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    tokens += len(output.outputs[0].new_token_ids)
                steps += 1
    finally:
        for target, method, original in originals:
            setattr(target, method, original)
        del engine._apply
    total = time.perf_counter() - start
    phases = {name: round(1e3 * seconds[name] / steps, 3) for name in ("propose", "schedule", "forward", "apply")}
    phases["other"] = round(1e3 * (total - sum(seconds[n] for n in ("propose", "schedule", "forward", "apply"))) / steps, 3)
    return {"steps": steps, "output_tokens": tokens, "tokens_per_step": round(tokens / steps, 2),
            "rows_per_step": round(rows[0] / steps, 2), "ms_per_step": phases,
            "ms_per_step_total": round(1e3 * total / steps, 3), "tok_s": round(tokens / total, 1)}


def operators(engine: Engine, prompt, prediction, num_steps: int = 20) -> list[tuple[str, float]]:
    """torch's profiler over `num_steps` decode steps of one request: (operator, self CPU ms per step), top 12."""
    engine.add_request(f"o{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=160, temperature=0),
                       prediction=prediction)
    for _ in range(3):  # past the prompt's prefill
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    table = sorted(((e.key, e.self_cpu_time_total / 1e3 / num_steps) for e in prof.key_averages()),
                   key=lambda item: -item[1])
    return [(key, round(ms, 3)) for key, ms in table[:12]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    pin_threads()
    engine = Engine.from_pretrained(gguf_file(), dtype=args.dtype, num_blocks=2400)
    prompts = [chat(engine, rewrite_prompt(t)) for t in TEXTS]
    timed(engine, prompts[:2], None)  # warm-up: first calls, prefix cache
    result = {"machine": machine_info(), "dtype": args.dtype}
    for side, predictions in (("plain", None), ("prediction", TEXTS)):
        result[side] = timed(engine, prompts, predictions)
        log(f"{side}: {result[side]}")
    for side, prediction in (("plain_operators", None), ("prediction_operators", TEXTS[0])):
        result[side] = operators(engine, prompts[0], prediction)
        log(f"{side}: {result[side]}")
    write_result("profile_speculative", False, result)


if __name__ == "__main__":
    main()
