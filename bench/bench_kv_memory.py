"""KV memory under four allocation policies: a discrete-time simulation, no model.

    .venv/bin/python bench/bench_kv_memory.py [--quick]

The trace (fixed seed): ShareGPT-shaped requests, the length statistics the vLLM paper
reports for ShareGPT (mean input 161, mean output 338 tokens): input and output lengths
are log-normal (sigma 1.0, long-tailed) with those means, input capped at 1024 and
input + output at a nominal 2048-token context (an OPT-13B-like context; no model runs, so
the context is a parameter, not stories260K's 512). Arrivals are Poisson at
`ARRIVALS_PER_STEP` requests per step, faster than any policy can serve, so every policy
runs memory-bound with a queue (as in the paper's measurement).

One step = every running request computes one token; a newly admitted request computes
its whole prompt (plus, after a preemption, the tokens it had made) in its first step.
Every policy sees the same arrivals, the same first-come-first-served admission (stop at
the first request that does not fit) and the same pool of `POOL_SLOTS` token slots:

  contiguous-max    reserves the max context (2048 slots) at admission, first-fit
  power-of-two      reserves the next power of two of prompt + output, buddy allocator
  exact-oracle      reserves exactly prompt + output (an oracle knows the output length), first-fit
  paged-B           this project's scheduler, KV cache manager and block pool (the real
                    runtime classes, no model), pages of B = 8, 16, 32 slots, taken as tokens
                    are computed; preemption by recompute when the pool runs dry

Per policy, over the measured window (after a warm-up): the share of reserved KV slots that
hold token states (time-integrated), the share of the whole pool that does, the batch size
(mean, max), tokens generated, preemptions. Results: bench/results/kv_memory.json, plots
kv_memory_token_share.png and kv_memory_batch.png.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import deque
from dataclasses import dataclass

from common import log, machine_info, pyplot, save_figure, write_result

from runtime.detokenizer import IncrementalDetokenizer
from runtime.kv_cache_manager import KVCacheManager
from runtime.request import Request, Sequence
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler

CONTEXT = 2048  # nominal model context (tokens)
POOL_SLOTS = 16384  # KV token slots for every policy: 8 max-length requests
MEAN_INPUT, MEAN_OUTPUT, SIGMA = 161, 338, 1.0
MAX_INPUT = 1024
ARRIVALS_PER_STEP = 0.25
SEED = 0
PAPER_TOKEN_SHARE = {"contiguous-max": 20.4, "power-of-two": 26.8, "exact-oracle": 38.2, "paged": 96.3}


@dataclass
class TraceRequest:
    request_id: str
    arrival_step: int
    num_prompt: int
    num_output: int


def make_trace(num_steps: int, seed: int = SEED) -> list[TraceRequest]:
    """Poisson arrivals over `num_steps`, log-normal input and output lengths (see the module doc)."""
    rng = random.Random(seed)
    mu_in = math.log(MEAN_INPUT) - SIGMA**2 / 2  # E[lognormal] = exp(mu + sigma^2 / 2)
    mu_out = math.log(MEAN_OUTPUT) - SIGMA**2 / 2
    trace, t = [], 0.0
    while True:
        t += rng.expovariate(ARRIVALS_PER_STEP)
        if t >= num_steps:
            return trace
        num_prompt = min(MAX_INPUT, max(1, round(rng.lognormvariate(mu_in, SIGMA))))
        num_output = min(CONTEXT - num_prompt, max(1, round(rng.lognormvariate(mu_out, SIGMA))))
        trace.append(TraceRequest(f"r{len(trace)}", int(t), num_prompt, num_output))


# --- contiguous allocators for the reservation policies ----------------------------------


class FirstFit:
    """A contiguous address space [0, size): first-fit holes, merged on free."""

    def __init__(self, size: int) -> None:
        self.holes = [(0, size)]  # (start, length), sorted by start

    def alloc(self, length: int) -> int | None:
        for i, (start, hole) in enumerate(self.holes):
            if hole >= length:
                self.holes[i] = (start + length, hole - length)
                if self.holes[i][1] == 0:
                    del self.holes[i]
                return start
        return None

    def free(self, start: int, length: int) -> None:
        self.holes.append((start, length))
        self.holes.sort()
        merged = [self.holes[0]]
        for s, n in self.holes[1:]:
            if merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.holes = merged


class Buddy:
    """A binary buddy allocator over a power-of-two address space."""

    def __init__(self, size: int) -> None:
        self.max_order = size.bit_length() - 1
        if 1 << self.max_order != size:
            raise ValueError("buddy allocator size must be a power of two")
        self.free_lists: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self.free_lists[self.max_order].add(0)

    def alloc(self, length: int) -> int | None:
        order = max(0, (length - 1).bit_length())
        for o in range(order, self.max_order + 1):
            if self.free_lists[o]:
                start = min(self.free_lists[o])
                self.free_lists[o].remove(start)
                while o > order:  # split, keep the low half
                    o -= 1
                    self.free_lists[o].add(start + (1 << o))
                return start
        return None

    def free(self, start: int, length: int) -> None:
        order = max(0, (length - 1).bit_length())
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self.free_lists[order]:
                break
            self.free_lists[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self.free_lists[order].add(start)


RESERVATIONS = {
    "contiguous-max": (lambda r: CONTEXT, FirstFit),
    "power-of-two": (lambda r: 1 << max(0, (r.num_prompt + r.num_output - 1).bit_length()), Buddy),
    "exact-oracle": (lambda r: r.num_prompt + r.num_output, FirstFit),
}


# --- the two simulators ------------------------------------------------------------------


class Timeline:
    """Per-step samples: token states held, slots reserved, batch size; tokens generated."""

    def __init__(self) -> None:
        self.token_states: list[int] = []
        self.reserved: list[int] = []
        self.batch: list[int] = []
        self.tokens_generated: list[int] = []

    def record(self, token_states: int, reserved: int, batch: int, generated: int) -> None:
        self.token_states.append(token_states)
        self.reserved.append(reserved)
        self.batch.append(batch)
        self.tokens_generated.append(generated)


def simulate_reservation(name: str, trace: list[TraceRequest], num_steps: int) -> Timeline:
    size_of, allocator_cls = RESERVATIONS[name]
    allocator = allocator_cls(POOL_SLOTS)
    arrivals = deque(trace)
    waiting: deque[TraceRequest] = deque()
    running: dict[str, list] = {}  # id -> [request, start, length, tokens generated]
    timeline = Timeline()
    for step in range(num_steps):
        while arrivals and arrivals[0].arrival_step <= step:
            waiting.append(arrivals.popleft())
        while waiting:  # first come first served: stop at the first that does not fit
            length = size_of(waiting[0])
            start = allocator.alloc(length)
            if start is None:
                break
            request = waiting.popleft()
            running[request.request_id] = [request, start, length, 0]
        for entry in running.values():
            entry[3] += 1  # one token per running request (the first comes with its prefill)
        held = sum(entry[0].num_prompt + entry[3] - 1 for entry in running.values())  # K/V written so far
        reserved = sum(entry[2] for entry in running.values())
        timeline.record(held, reserved, len(running), len(running))
        for request_id in [rid for rid, e in running.items() if e[3] == e[0].num_output]:
            _, start, length, _ = running.pop(request_id)
            allocator.free(start, length)
    return timeline


def simulate_paged(block_size: int, trace: list[TraceRequest], num_steps: int) -> tuple[Timeline, int]:
    """The real Scheduler + KVCacheManager + BlockPool; sampling is replaced by a dummy token."""
    kv = KVCacheManager(POOL_SLOTS // block_size, block_size, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=1 << 20, max_num_batched_tokens=1 << 20)  # memory is the only limit
    arrivals = deque(trace)
    num_output: dict[str, int] = {}
    timeline = Timeline()
    for step in range(num_steps):
        while arrivals and arrivals[0].arrival_step <= step:
            r = arrivals.popleft()
            prompt = [3 + (i % 500) for i in range(r.num_prompt)]
            request = Request(r.request_id, None, prompt, SamplingParams(max_tokens=r.num_output), None)
            seq = Sequence(request, 0, list(prompt), IncrementalDetokenizer(None, prompt))
            request.sequences.append(seq)
            num_output[r.request_id] = r.num_output
            scheduler.add(seq)
        batch = scheduler.schedule()
        sampled = [seq for seq, _, _ in scheduler.advance(batch)]
        for seq in sampled:
            seq.token_ids.append(7)  # the dummy sampled token
        held = sum(seq.num_computed_tokens for seq in scheduler.running)
        reserved = (kv.pool.num_blocks - kv.pool.num_free_blocks) * block_size
        timeline.record(held, reserved, len(scheduler.running), len(sampled))
        for seq in sampled:
            if seq.num_output_tokens == num_output[seq.request.request_id]:
                scheduler.finish(seq, "length")
    for seq in [*scheduler.running, *scheduler.waiting]:
        scheduler.finish(seq, "abort")
    kv.check_invariants()
    return timeline, scheduler.num_preemptions


def summarize(name: str, timeline: Timeline, warmup: int, preemptions: int | None) -> dict:
    window = slice(warmup, None)
    held, reserved, batch = timeline.token_states[window], timeline.reserved[window], timeline.batch[window]
    out = {
        "policy": name,
        "token_share_of_reserved_pct": round(100 * sum(held) / sum(reserved), 2),
        "token_share_of_pool_pct": round(100 * sum(held) / (POOL_SLOTS * len(held)), 2),
        "reserved_share_of_pool_pct": round(100 * sum(reserved) / (POOL_SLOTS * len(held)), 2),
        "mean_batch": round(sum(batch) / len(batch), 2),
        "max_batch": max(batch),
        "tokens_generated": sum(timeline.tokens_generated[window]),
    }
    if preemptions is not None:
        out["preemptions"] = preemptions
    return out


def plot(timelines: dict[str, Timeline], warmup: int, quick: bool) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, tl in timelines.items():
        share = [100 * h / r if r else float("nan") for h, r in zip(tl.token_states, tl.reserved)]
        top.plot(share, label=name, linewidth=1)
        bottom.plot([h / 1000 for h in tl.token_states], label=name, linewidth=1)
    top.set_ylabel("token states / reserved KV (%)")
    top.set_ylim(0, 105)
    bottom.set_ylabel("token states (k slots)")
    bottom.axhline(POOL_SLOTS / 1000, color="grey", linestyle=":", label="pool")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.axvline(warmup, color="black", linewidth=0.5, linestyle="--")
    top.legend(fontsize=8, ncol=3)
    top.set_title(f"KV memory holding token states, same trace and {POOL_SLOTS}-slot pool")
    save_figure(fig, "kv_memory_token_share", quick)
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, tl in timelines.items():
        ax.plot(tl.batch, label=name, linewidth=1)
    ax.axvline(warmup, color="black", linewidth=0.5, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("running requests (batch size)")
    ax.set_title("Batch size over time, same trace and pool")
    ax.legend(fontsize=8, ncol=3)
    save_figure(fig, "kv_memory_batch", quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter trace, for a smoke run")
    args = parser.parse_args()
    num_steps, warmup = (1500, 300) if args.quick else (6000, 1000)
    trace = make_trace(num_steps)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    log(f"trace: {len(trace)} requests over {num_steps} steps, mean input {mean([r.num_prompt for r in trace]):.1f}, "
        f"mean output {mean([r.num_output for r in trace]):.1f}")
    timelines: dict[str, Timeline] = {}
    policies = []
    for name in RESERVATIONS:
        start = time.perf_counter()
        timelines[name] = simulate_reservation(name, trace, num_steps)
        policies.append(summarize(name, timelines[name], warmup, None))
        log(f"{name}: {policies[-1]} ({time.perf_counter() - start:.1f}s)")
    for block_size in (8, 16, 32):
        start = time.perf_counter()
        name = f"paged-{block_size}"
        timelines[name], preemptions = simulate_paged(block_size, trace, num_steps)
        policies.append(summarize(name, timelines[name], warmup, preemptions))
        log(f"{name}: {policies[-1]} ({time.perf_counter() - start:.1f}s)")
    paged16 = next(p for p in policies if p["policy"] == "paged-16")
    result = {
        "machine": machine_info(),
        "trace": {
            "distribution": f"log-normal input (mean {MEAN_INPUT}, sigma {SIGMA}, cap {MAX_INPUT}) and output "
                            f"(mean {MEAN_OUTPUT}, sigma {SIGMA}, input + output <= {CONTEXT}); Poisson arrivals "
                            f"{ARRIVALS_PER_STEP}/step; seed {SEED}",
            "context": CONTEXT, "pool_slots": POOL_SLOTS, "num_steps": num_steps, "warmup_steps": warmup,
            "num_requests": len(trace),
            "mean_input": round(mean([r.num_prompt for r in trace]), 1),
            "mean_output": round(mean([r.num_output for r in trace]), 1),
            "max_input": max(r.num_prompt for r in trace), "max_output": max(r.num_output for r in trace),
        },
        "policies": policies,
        "batch_ratio_paged16_vs": {p["policy"]: round(paged16["mean_batch"] / p["mean_batch"], 2)
                                   for p in policies if p["policy"] in RESERVATIONS},
        "vllm_paper_token_share_pct": PAPER_TOKEN_SHARE,
        "goal": "paged token share of reserved >= 97%",
    }
    write_result("kv_memory", args.quick, result)
    plot(timelines, warmup, args.quick)


if __name__ == "__main__":
    main()
