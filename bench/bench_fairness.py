"""Fair scheduling on the real engine: a flood against a light tenant, and backlogged tenants sharing by weight.

    .venv/bin/python bench/bench_fairness.py [--quick] [--dtype float32] [--model PATH]

The engine (SmolLM2's Q4_1 GGUF by default; 64 seats, pages for all of them) is driven in
this process, one step after another, with requests added when they are due by the clock:

flood   tenant A adds FLOOD_REQUESTS requests at once (512 prompt tokens, 128 output tokens
        each, EOS ignored); tenant B adds one request of 64 prompt + 32 output tokens every
        second from t = 1 s until A's last request has started. Run as: B alone (no flood,
        fcfs then fair), then the flood under `fcfs` and `fair` in alternated pairs (fcfs fair,
        fair fcfs; --repeats). Reported: B's TTFT p50 / p99 in seconds and in engine steps,
        B's output tok/s after its first token, the flooded engine's median step time,
        everyone's output tok/s, and the tokens computed per second (prompt tokens computed
        plus tokens generated: the work done, whatever the mix of the two runs); the goals
        use the medians over the pairs.
shares  two tenants each keep BACKLOG requests waiting (256 prompt + 64 output tokens), with
        weights 1:1, then 1:3, under `fair`; every SHARE_WINDOW_S seconds the weighted service
        (1 x prompt tokens computed + 2 x tokens generated, the engine's own counters) each
        got in that window. Reported: the ratio per window, and the largest gap between
        the two tenants' service divided by their weights over any window, against the bound
        of Sheng et al. (OSDI '24, Theorem: two backlogged clients' service differs by at
        most 2U, U = max(w_p * L_input, w_q * M); L_input the longest prompt, M the most
        tokens one batch holds).

Prompts are random token ids (distinct per request: no prefix hits), so only lengths
matter. Results: bench/results/fairness.json; BENCHMARKS.md section 19.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import alternated, log, machine_info, pin_threads, write_result

from runtime import Engine, SamplingParams  # noqa: E402
from smollm2 import gguf_file  # noqa: E402

FLOOD_REQUESTS = 200
FLOOD_PROMPT, FLOOD_OUTPUT = 512, 128
LIGHT_PROMPT, LIGHT_OUTPUT = 64, 32
LIGHT_EVERY_S = 1.0
BACKLOG = 48  # requests each backlogged tenant keeps waiting
SHARE_PROMPT, SHARE_OUTPUT = 256, 64
SHARE_WINDOW_S = 10.0
MAX_NUM_SEQS = 64


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Driver:
    """Steps one engine, adding requests when due; keeps per-request arrival, first-token and finish times."""

    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.ids = iter(range(10**9))
        self.arrived: dict[str, tuple[float, int, str]] = {}  # id -> (time, step, tenant)
        self.first: dict[str, tuple[float, int]] = {}
        self.finished: dict[str, tuple[float, int]] = {}
        self.step_seconds: list[float] = []
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, tenant: str, prompt_len: int, output_len: int, weight: float = 1.0) -> str:
        request_id = f"{tenant}-{next(self.ids)}"
        prompt = [self.rng.randrange(1000, 40000) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params, tenant=tenant, tenant_weight=weight)
        self.arrived[request_id] = (time.perf_counter() - self.start, self.steps, tenant)
        return request_id

    def step(self) -> None:
        began = time.perf_counter()
        outputs = self.engine.step()
        now = time.perf_counter()
        self.step_seconds.append(now - began)
        self.steps += 1
        for output in outputs:
            rid = output.request_id
            if rid not in self.first and output.outputs and output.outputs[0].new_token_ids:
                self.first[rid] = (now - self.start, self.steps)
            if output.finished:
                self.finished[rid] = (now - self.start, self.steps)

    def now(self) -> float:
        return time.perf_counter() - self.start


def flood_run(path, dtype: str, scheduling: str, flood: bool, num_flood: int, num_blocks: int) -> dict:
    engine = Engine.from_pretrained(path, dtype=dtype, num_blocks=num_blocks, max_num_seqs=MAX_NUM_SEQS,
                                    scheduling=scheduling)
    driver = Driver(engine, seed=1)
    flood_ids = [driver.add("A", FLOOD_PROMPT, FLOOD_OUTPUT) for _ in range(num_flood)] if flood else []
    light_ids: list[str] = []
    next_light = LIGHT_EVERY_S
    flood_started_at = None
    last_report = 0.0
    while True:
        now = driver.now()
        flood_waiting = flood and any(rid not in driver.first for rid in flood_ids)
        if now >= next_light and (flood_waiting or (not flood and len(light_ids) < 20)):
            light_ids.append(driver.add("B", LIGHT_PROMPT, LIGHT_OUTPUT))
            next_light += LIGHT_EVERY_S
        if flood and flood_started_at is None and not flood_waiting:
            flood_started_at = now
        if not engine.has_unfinished_requests():
            if not flood and len(light_ids) < 20:
                time.sleep(max(0.0, next_light - driver.now()))
                continue
            break
        driver.step()
        if now - last_report > 15:
            last_report = now
            log(f"    {scheduling}{'' if flood else ' (B alone)'}: t={now:.0f}s, {driver.steps} steps, "
                f"{sum(1 for r in flood_ids if r in driver.finished)}/{len(flood_ids)} flood requests done, "
                f"{len(light_ids)} light sent")
    ttft_s = [driver.first[r][0] - driver.arrived[r][0] for r in light_ids]
    ttft_steps = [driver.first[r][1] - driver.arrived[r][1] for r in light_ids]
    light_rates = [(LIGHT_OUTPUT - 1) / (driver.finished[r][0] - driver.first[r][0]) for r in light_ids
                   if driver.finished[r][0] > driver.first[r][0]]
    total_tokens = len(flood_ids) * FLOOD_OUTPUT + len(light_ids) * LIGHT_OUTPUT
    elapsed = max(t for t, _ in driver.finished.values())
    stats = engine.stats()
    return {
        "scheduling": scheduling, "flood": flood, "light_requests": len(light_ids), "steps": driver.steps,
        "light_ttft_s_p50": percentile(ttft_s, 0.5), "light_ttft_s_p99": percentile(ttft_s, 0.99),
        "light_ttft_steps_p50": percentile(ttft_steps, 0.5), "light_ttft_steps_p99": percentile(ttft_steps, 0.99),
        "light_tok_s_after_first": round(statistics.median(light_rates), 1) if light_rates else None,
        "step_ms_median": round(1e3 * statistics.median(driver.step_seconds), 1),
        "output_tok_s": round(total_tokens / elapsed, 1), "seconds": round(elapsed, 1),
        # the work done per second, whatever its mix: prompt tokens computed (hits excluded) and tokens generated
        "computed_tok_s": round(sum(t["served_input_tokens"] + t["served_output_tokens"]
                                    for t in stats["tenants"].values()) / elapsed, 1),
        "preemptions": stats["num_preemptions"], "tenants": stats["tenants"],
    }


def shares_run(path, dtype: str, weights: tuple[float, float], seconds: float, num_blocks: int) -> dict:
    engine = Engine.from_pretrained(path, dtype=dtype, num_blocks=num_blocks, max_num_seqs=MAX_NUM_SEQS,
                                    scheduling="fair")
    driver = Driver(engine, seed=2)
    tenants = {"A": weights[0], "C": weights[1]}
    counters = engine.scheduler.counters
    windows: list[dict[str, float]] = []
    last = {t: 0.0 for t in tenants}
    next_window = SHARE_WINDOW_S

    def service(tenant: str) -> float:  # weighted as the engine's counters weigh (before the tenant's weight)
        return (counters.input_weight * counters.served_input.get(tenant, 0)
                + counters.output_weight * counters.served_output.get(tenant, 0))

    while driver.now() < seconds:
        for tenant, weight in tenants.items():  # keep each backlogged
            while engine.scheduler.waiting.depth(tenant) < BACKLOG:
                driver.add(tenant, SHARE_PROMPT, SHARE_OUTPUT, weight)
        driver.step()
        if driver.now() >= next_window:
            windows.append({t: service(t) - last[t] for t in tenants})
            last = {t: service(t) for t in tenants}
            next_window += SHARE_WINDOW_S
            log(f"    weights {weights}: window {len(windows)}: {windows[-1]}")
    ratios = [w["C"] / w["A"] for w in windows if w["A"] > 0]
    gaps = [abs(w["A"] / tenants["A"] - w["C"] / tenants["C"]) for w in windows]
    batch_tokens = engine.scheduler.max_num_batched_tokens
    # M: the most tokens one batch holds (every seat at its longest sequence)
    bound = 2 * max(counters.input_weight * SHARE_PROMPT,
                    counters.output_weight * MAX_NUM_SEQS * (SHARE_PROMPT + SHARE_OUTPUT))
    return {"weights": list(weights), "windows": [{t: round(v) for t, v in w.items()} for w in windows],
            "ratio_c_over_a_per_window": [round(r, 3) for r in ratios],
            "ratio_min": round(min(ratios), 3) if ratios else None, "ratio_max": round(max(ratios), 3) if ratios else None,
            "ratio_total": round(sum(w["C"] for w in windows) / max(1.0, sum(w["A"] for w in windows)), 3),
            "largest_weighted_gap": round(max(gaps), 1) if gaps else None, "vtc_bound": bound,
            "max_num_batched_tokens": batch_tokens, "preemptions": engine.stats()["num_preemptions"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller flood and shorter share runs")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="a checkpoint folder or GGUF (default: SmolLM2's Q4_1 GGUF)")
    parser.add_argument("--repeats", type=int, default=2, help="flood pairs, alternated: fcfs fair, fair fcfs, ...")
    args = parser.parse_args()
    pin_threads()
    path = args.model or gguf_file()
    num_flood = 2 * MAX_NUM_SEQS if args.quick else FLOOD_REQUESTS  # more than the seats, or nobody waits
    num_blocks = MAX_NUM_SEQS * (FLOOD_PROMPT + FLOOD_OUTPUT) // 16 + 256  # every seat's pages (16 slots each)
    share_seconds = 20.0 if args.quick else 60.0
    result = {"machine": machine_info(), "model": str(path).rsplit("/", 1)[-1], "dtype": args.dtype,
              "max_num_seqs": MAX_NUM_SEQS, "flood": {}, "shares": []}
    for name, scheduling in (("light_alone", "fcfs"), ("light_alone_fair", "fair")):
        log(f"flood: {name}")
        result["flood"][name] = row = flood_run(path, args.dtype, scheduling, False, num_flood, num_blocks)
        log(f"  {name}: {({k: v for k, v in row.items() if k != 'tenants'})}")
    runs: dict[str, list[dict]] = {"fcfs": [], "fair": []}
    for repeat, scheduling in alternated(("fcfs", "fair"), args.repeats):  # a slow minute hurts both
        log(f"flood: {scheduling} (pair {repeat + 1}/{args.repeats})")
        runs[scheduling].append(row := flood_run(path, args.dtype, scheduling, True, num_flood, num_blocks))
        log(f"  {scheduling}: {({k: v for k, v in row.items() if k != 'tenants'})}")
    result["flood"]["fcfs"], result["flood"]["fair"] = runs["fcfs"][0], runs["fair"][0]
    result["flood_runs"] = runs
    fcfs_p99 = statistics.median(r["light_ttft_s_p99"] for r in runs["fcfs"])
    fair_p99 = statistics.median(r["light_ttft_s_p99"] for r in runs["fair"])
    result["goals"] = {
        "light_ttft_p99_fair_in_steps": max(r["light_ttft_steps_p99"] for r in runs["fair"]),
        "light_ttft_p99_fair_over_fcfs": round(fair_p99 / fcfs_p99, 4) if fcfs_p99 else None,
        "output_tok_s_fair_over_fcfs": round(statistics.median(r["output_tok_s"] for r in runs["fair"])
                                             / statistics.median(r["output_tok_s"] for r in runs["fcfs"]), 3),
        "output_tok_s_fair_over_fcfs_per_pair": [round(a["output_tok_s"] / b["output_tok_s"], 3)
                                                 for a, b in zip(runs["fair"], runs["fcfs"])],
        "computed_tok_s_fair_over_fcfs": round(statistics.median(r["computed_tok_s"] for r in runs["fair"])
                                               / statistics.median(r["computed_tok_s"] for r in runs["fcfs"]), 3),
    }
    for weights in ((1.0, 1.0), (1.0, 3.0)):
        log(f"shares: weights {weights}")
        result["shares"].append(row := shares_run(path, args.dtype, weights, share_seconds, num_blocks))
        log(f"  {row}")
    log(f"goals: {result['goals']}")
    write_result("fairness", args.quick, result)


if __name__ == "__main__":
    main()
