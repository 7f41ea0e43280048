"""Prefix caching on vs off in the engine: a shared-system-prompt workload, and the cost at a 0% hit rate.

    .venv/bin/python bench/bench_prefix.py [--repeats 3] [--quick]

Model: the ~20M-parameter random-weight Llama (1024-token context), float32, torch threads
pinned. Prompts are token ids (fixed seeds). Greedy, EOS ignored, `OUTPUT_TOKENS` each.
The two engines (cache on, cache off) are built once and reused; runs alternate
(on off, off on, on off) and each figure is the median of the repeats.

1. Shared system prompts: `NUM_SYSTEMS` system prompts of 256 tokens, each followed by a
   distinct 256-token suffix, `PER_SYSTEM` requests per system prompt, interleaved
   (s0 s1 ... s9 s0 s1 ...).
   - batch: all requests submitted at once; output tokens/s, and TTFT (submission -> first
     token) mean and p50 over the requests.
   - isolated TTFT: for each system prompt, one request that has been seen (its system
     prompt computed by an earlier request), submitted alone: the prefill latency a cache
     hit saves. (With the cache off the earlier request is run too, and helps nothing.)
2. 0% hit rate: 24 requests, every prompt distinct (nothing shared), all at once, on the
   20M model (512-token prompts) and on stories260K (496-token prompts; a tiny model, so
   the cache's bookkeeping weighs most): wall time with the cache on over off, median of
   at least 5 alternated repeats; and, measured directly, the time spent in the prefix
   cache's own code (hashing, lookups, caching and evicting hashes) as a share of the run
   with the cache on. Goal: at most 1% slower.
Results: bench/results/prefix_cache.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import (timed, STORIES, log, machine_info, median, percentile, pin_threads, quick_mode, random_llama_dir,
                    wait_for_quiet, write_result)

from runtime import Engine, SamplingParams  # noqa: E402

SYSTEM_LEN, SUFFIX_LEN = 256, 256
OUTPUT_TOKENS = 16
NUM_BLOCKS = 4096  # 65536 token slots: nothing is evicted during a run


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(n)]


def shared_workload(num_systems: int, per_system: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(batch prompts interleaved by system prompt, one more unseen-suffix prompt per system prompt)."""
    rng = random.Random(seed)
    systems = [[1] + token_ids(rng, SYSTEM_LEN - 1) for _ in range(num_systems)]
    batch = [systems[s] + token_ids(rng, SUFFIX_LEN) for _ in range(per_system) for s in range(num_systems)]
    probes = [systems[s] + token_ids(rng, SUFFIX_LEN) for s in range(num_systems)]
    return batch, probes


def distinct_workload(num: int, seed: int, length: int = SYSTEM_LEN + SUFFIX_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + token_ids(rng, length - 1) for _ in range(num)]


class Runner:
    """One engine (cache on or off), reused; each run uses fresh request ids and a fresh salt.

    A new salt per run starts a new hash chain, so a run never hits pages cached by the
    previous run of the same engine: every run starts from a cold cache.

    The prefix cache's own work is timed in this process (runtime/ unchanged) by wrapping,
    on this engine's instances, the three places it happens: the lookup at admission
    (hashing the prompt's full blocks), offering computed full blocks to the cache after a
    step, and evicting a cached page's hash when the page is handed out again.
    """

    def __init__(self, model_dir, caching: bool) -> None:
        self.engine = Engine.from_pretrained(model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=64,
                                             max_num_batched_tokens=1024, enable_prefix_caching=caching)
        self.runs = 0
        self.params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
        self.cache_time = [0.0]
        kv = self.engine.kv
        kv.find_cached_prefix = timed(kv.find_cached_prefix, self.cache_time)
        kv.cache_computed_blocks = timed(kv.cache_computed_blocks, self.cache_time)
        kv.pool._evict = timed(kv.pool._evict, self.cache_time)

    def batch(self, prompts: list[list[int]]) -> dict:
        """All prompts at once: output tokens/s, TTFT per request, prompt tokens served from cache."""
        self.runs += 1
        salt = f"run-{self.runs}"
        self.cache_time[0] = 0.0
        start = time.perf_counter()
        ids = [f"p{self.runs}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.engine.add_request(request_id, prompt, self.params, cache_salt=salt)
        ttft: dict[str, float] = {}
        cached = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id not in ttft and out.outputs[0].token_ids:
                    ttft[out.request_id] = time.perf_counter() - start
                if out.finished:
                    cached += out.num_cached_tokens
        elapsed = time.perf_counter() - start
        values = list(ttft.values())
        return {"seconds": elapsed, "output_tok_per_s": len(prompts) * OUTPUT_TOKENS / elapsed,
                "cache_work_pct": 100 * self.cache_time[0] / elapsed,
                "ttft_mean_s": statistics.fmean(values), "ttft_p50_s": percentile(values, 0.5),
                "cached_prompt_tokens": cached, "prompt_tokens": sum(map(len, prompts))}

    def isolated_ttft(self, warm: list[list[int]], probes: list[list[int]]) -> dict:
        """Per system prompt: run a request with it, then time a new-suffix request alone (TTFT)."""
        self.runs += 1
        salt = f"run-{self.runs}"
        times = []
        for i, (first, probe) in enumerate(zip(warm, probes)):
            self.engine.generate([first], self.params, cache_salt=salt)
            request_id = f"t{self.runs}-{i}"
            start = time.perf_counter()
            self.engine.add_request(request_id, probe, self.params, cache_salt=salt)
            first_token = None
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if first_token is None and out.outputs[0].token_ids:
                        first_token = time.perf_counter() - start
            times.append(first_token)
        return {"ttft_mean_s": statistics.fmean(times), "ttft_p50_s": percentile(times, 0.5)}


def alternate(runners: dict[str, Runner], repeats: int, label: str, fn) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            background = wait_for_quiet()
            result = fn(runners[name])
            result["background_cpu_pct"] = background
            runs[name].append(result)
            log(f"{label}: cache {name} repeat {r + 1}/{repeats}: " +
                ", ".join(f"{k}={v:.4g}" for k, v in result.items() if isinstance(v, float)))
    return runs


def med(runs: list[dict], key: str, digits: int = 4) -> float:
    return round(median([r[key] for r in runs]), digits)


def spread(runs: list[dict]) -> list[float]:
    return [round(min(r["seconds"] for r in runs), 3), round(max(r["seconds"] for r in runs), 3)]


def zero_hit(name: str, model_dir, prompt_len: int, num: int, repeats: int) -> dict:
    """Distinct prompts only: wall time cache on vs off, and the cache's own work as a share of the run."""
    runners = {"on": Runner(model_dir, True), "off": Runner(model_dir, False)}
    prompts = distinct_workload(num, seed=6, length=prompt_len)
    for runner in runners.values():
        runner.batch(distinct_workload(4, seed=7, length=prompt_len))  # warm-up
    runs = alternate(runners, repeats, f"0% hit rate, {name}", lambda r: r.batch(prompts))
    on_s, off_s = med(runs["on"], "seconds"), med(runs["off"], "seconds")
    return {
        "model": name, "num_requests": num, "prompt_tokens": prompt_len, "repeats": repeats,
        "cache_on_s": on_s, "cache_off_s": off_s,
        "slowdown_pct": round(100 * (on_s / off_s - 1), 2),
        "spread_on_s": spread(runs["on"]),
        "spread_off_s": spread(runs["off"]),
        "cache_work_pct_on": round(median([r["cache_work_pct"] for r in runs["on"]]), 3),
        # with the cache off the same wrapped calls return at once: what the timing itself costs
        "cache_work_pct_off": round(median([r["cache_work_pct"] for r in runs["off"]]), 3),
        "cached_prompt_tokens_on": runs["on"][0]["cached_prompt_tokens"],
        "goal": "slowdown <= 1%",
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick); 0%% hit: at least 5")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    quick_mode(args.quick)
    repeats = args.repeats or (1 if args.quick else 3)
    zero_hit_repeats = 1 if args.quick else max(5, repeats)
    pin_threads()
    num_systems, per_system = (4, 2) if args.quick else (10, 4)
    batch, probes = shared_workload(num_systems, per_system, seed=5)
    model_dir, tmp = random_llama_dir()
    with tmp:
        runners = {"on": Runner(model_dir, True), "off": Runner(model_dir, False)}
        log("warm-up")
        for runner in runners.values():
            runner.batch(distinct_workload(4, seed=7))
        shared = alternate(runners, repeats, "shared prompts, batch", lambda r: r.batch(batch))
        isolated = alternate(runners, repeats, "shared prompts, isolated TTFT",
                             lambda r: r.isolated_ttft(batch[:num_systems], probes))
        del runners
        num_distinct = 8 if args.quick else 24
        misses = [zero_hit("random-llama-20M", model_dir, SYSTEM_LEN + SUFFIX_LEN, num_distinct, zero_hit_repeats),
                  zero_hit("stories260K", STORIES, 496, num_distinct, zero_hit_repeats)]
    on, off = shared["on"], shared["off"]
    result = {
        "machine": machine_info(),
        "model": "random-llama-20M",
        "repeats": repeats,
        "workload": {"system_prompt_tokens": SYSTEM_LEN, "suffix_tokens": SUFFIX_LEN, "num_system_prompts": num_systems,
                     "requests_per_system_prompt": per_system, "num_requests": len(batch),
                     "output_tokens": OUTPUT_TOKENS},
        "shared_batch": {
            "cache_on": {k: med(on, k) for k in ("output_tok_per_s", "ttft_mean_s", "ttft_p50_s", "seconds")},
            "cache_off": {k: med(off, k) for k in ("output_tok_per_s", "ttft_mean_s", "ttft_p50_s", "seconds")},
            "cached_prompt_share_pct": round(100 * on[0]["cached_prompt_tokens"] / on[0]["prompt_tokens"], 1),
            "throughput_ratio_on_over_off": round(med(on, "output_tok_per_s") / med(off, "output_tok_per_s"), 2),
            "ttft_mean_ratio_on_over_off": round(med(on, "ttft_mean_s") / med(off, "ttft_mean_s"), 3),
            "runs": shared,
        },
        "isolated_ttft": {
            "cache_on_ms": round(1e3 * med(isolated["on"], "ttft_p50_s", 6), 2),
            "cache_off_ms": round(1e3 * med(isolated["off"], "ttft_p50_s", 6), 2),
            "ttft_p50_ratio_on_over_off": round(med(isolated["on"], "ttft_p50_s", 6)
                                                / med(isolated["off"], "ttft_p50_s", 6), 3),
            "runs": isolated,
        },
        "zero_hit": misses,
    }
    log(f"shared: throughput x{result['shared_batch']['throughput_ratio_on_over_off']}, "
        f"TTFT mean x{result['shared_batch']['ttft_mean_ratio_on_over_off']}, isolated TTFT "
        f"x{result['isolated_ttft']['ttft_p50_ratio_on_over_off']}; 0% hit: " +
        ", ".join(f"{m['model']} {m['slowdown_pct']}% wall, cache work {m['cache_work_pct_on']}%" for m in misses))
    write_result("prefix_cache", args.quick, result)


if __name__ == "__main__":
    main()
