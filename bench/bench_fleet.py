"""A fleet this machine cannot hold: 64 to 1,024 simulated workers, KV-aware vs round-robin vs random.

No model runs. Each simulated worker is the real runtime bookkeeping (runtime.Scheduler,
KVCacheManager, BlockPool, the salted block hashes, its KV events); a step takes the time a
cost model says, fitted on this machine to the ~20M random Llama's measured engine steps:

    step_s = a + b * prefill_tokens + c * decode_seqs + d * decode_context_tokens

A discrete-event loop delivers a multi-tenant trace (Poisson arrivals; tenants x system
prompts with Zipf popularity; a user turn each). Routing policies:

    kv           Dynamo's KV router cost (docs: "Router Design"), its defaults: for each
                 worker, potential prefill blocks (the uncached prompt tokens of the requests
                 routed there and not yet prefilled, plus this one's) + potential decode blocks
                 (blocks of the requests routed there and not finished, plus this one's); the
                 lowest wins (ties at random). Overlap comes from an index fed only by the
                 workers' KV events (BlockStored / BlockRemoved), as Dynamo's indexer is; the
                 load from the router's own count of what it routed, as Dynamo's is
    round_robin  the next worker in turn
    random       a worker at random

Per fleet size and offered load: prefix hit rate, TTFT p50 / p99, output tok/s, and the
capacity (the highest offered load whose TTFT p99 stays under the SLO). Writes
bench/results/fleet.json and fleet.png.

    .venv/bin/python bench/bench_fleet.py [--quick] [--workers 64 256 1024]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

import common
from common import log, machine_info, percentile, write_result
from runtime.block_hash import extend_block_hashes
from runtime.kv_cache_manager import KVCacheManager
from runtime.kv_events import BlockStored
from runtime.request import Request, Sequence
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler

BLOCK_SIZE = 16
NUM_BLOCKS = 512  # per worker: 8,192 token slots, about seven system prompts
MAX_NUM_SEQS = 32
MAX_BATCHED = 2048
SYSTEM_TOKENS = 1024
USER_TOKENS = 64
OUTPUT_TOKENS = 32
PREFIXES_PER_WORKER = 8  # distinct (tenant, system prompt) pairs in the trace, per worker
PROMPTS_PER_TENANT = 2
ZIPF_S = 1.0
TTFT_SLO_S = 2.0
POLICIES = ("kv", "round_robin", "random")


# --- the cost model ---------------------------------------------------------------------------


def calibrate(model: Path) -> dict:
    """Fit step_s = a + b*prefill_tokens + c*decode_seqs + d*decode_context_tokens to measured steps."""
    import torch

    from runtime import Engine

    common.pin_threads()
    engine = Engine.from_pretrained(model, num_blocks=4096, max_num_seqs=64, max_num_batched_tokens=2048)
    rows, times = [], []
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [1] + [rng.randrange(3, 512) for _ in range(n - 1)]

    for tokens in (128, 384, 640, 960):  # prefill steps (the model takes 1,024 positions)
        samples = []
        for _ in range(5):
            engine.add_request(f"p{tokens}-{len(times)}-{len(samples)}", prompt(tokens),
                               SamplingParams(max_tokens=1, temperature=0))
            start = time.perf_counter()
            engine.step()
            samples.append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
        times.append(statistics.median(samples))  # one point per shape: the median of its repeats
        rows.append([1.0, tokens, 0, 0])
    for seqs, context in ((1, 256), (8, 256), (32, 256), (8, 896), (32, 896), (64, 896)):  # decode steps
        for i in range(seqs):
            engine.add_request(f"d{seqs}-{context}-{i}", prompt(context), SamplingParams(max_tokens=40, temperature=0,
                                                                                      ignore_eos=True))
        scheduler = engine.scheduler
        while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
            engine.step()  # prefill them all; the timed steps below are decodes only
        samples = []
        for _ in range(9):
            ctx = sum(s.num_computed_tokens for s in engine.scheduler.running)
            start = time.perf_counter()
            engine.step()
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        rows.append([1.0, 0, seqs, ctx])
        for request_id in engine.unfinished_request_ids():
            engine.abort_request(request_id)
        engine.step()
    x, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(times, dtype=torch.float64)
    prefill = x[:, 1] > 0  # fitted apart: a prefill step's cost is its tokens; a decode step's, its rows and context

    def fit(columns: list[int], mask) -> list[float]:  # least squares in relative error: each row divided by its time
        rel = x[mask][:, columns] / y[mask].unsqueeze(1)
        return torch.linalg.lstsq(rel, torch.ones(len(rel), 1, dtype=torch.float64)).solution.squeeze(1).clamp(
            min=0).tolist()

    a_p, b = fit([0, 1], prefill)
    a_d, c, d = fit([0, 2, 3], ~prefill)
    cost = {"a_s": a_d, "b_s_per_prefill_token": b, "c_s_per_decode_seq": c, "d_s_per_context_token": d,
            "prefill_intercept_s": a_p, "num_steps": len(times)}
    predicted = torch.tensor([cost["a_s"] + b * r[1] + c * r[2] + d * r[3] for r in rows], dtype=torch.float64)
    cost["median_rel_error"] = ((predicted - y).abs() / y).median().item()
    cost["max_rel_error"] = ((predicted - y).abs() / y).max().item()
    return cost


def step_cost(cost: dict, batch) -> float:
    prefill = decode_seqs = context = 0
    for entry in batch.entries:
        if entry.num_new_tokens == 1 and entry.num_sample_rows == 1:  # a decode (or a prompt's last token)
            decode_seqs += 1
            context += entry.start_position
        else:
            prefill += entry.num_new_tokens
    return (cost["a_s"] + cost["b_s_per_prefill_token"] * prefill + cost["c_s_per_decode_seq"] * decode_seqs
            + cost["d_s_per_context_token"] * context)


# --- simulated workers and the router's index -------------------------------------------------


class SimWorker:
    """One worker's real page and batch bookkeeping; the model is the cost model."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.kv.pool.kv_events = []
        self.scheduler = Scheduler(self.kv, MAX_NUM_SEQS, MAX_BATCHED)
        self.busy = False


class EventIndex:
    """Which worker caches which block, from KV events only (the router's view, as Dynamo's indexer)."""

    def __init__(self) -> None:
        self.holders: dict[bytes, set[int]] = defaultdict(set)

    def apply(self, worker_id: int, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.holders[event.block_hash].add(worker_id)
            else:
                holders = self.holders.get(event.block_hash)
                if holders is not None:
                    holders.discard(worker_id)
                    if not holders:
                        del self.holders[event.block_hash]

    def overlaps(self, block_hashes: list[bytes]) -> dict[int, int]:
        """Worker id -> leading blocks it holds (only workers holding at least the first)."""
        depth: dict[int, int] = {}
        alive: set[int] | None = None
        for i, block_hash in enumerate(block_hashes):
            holders = self.holders.get(block_hash, set())
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                depth[worker_id] = i + 1
        return depth


# --- the trace and the loop ---------------------------------------------------------------------


def make_trace(num_workers: int, num_requests: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    """(arrival s, prefix id, user seed) per request; prefix popularity is Zipf over all prefixes."""
    rng = random.Random(seed)
    num_prefixes = PREFIXES_PER_WORKER * num_workers
    weights = [1.0 / (rank + 1) ** ZIPF_S for rank in range(num_prefixes)]
    prefixes = rng.choices(range(num_prefixes), weights=weights, k=num_requests)
    at, trace = 0.0, []
    for prefix in prefixes:
        at += rng.expovariate(rate)
        trace.append((at, prefix, rng.randrange(1 << 30)))
    return trace


def _prompt(prefix: int, user_seed: int) -> list[int]:
    rng = random.Random(prefix * 7919)
    system = [1] + [rng.randrange(3, 512) for _ in range(SYSTEM_TOKENS - 1)]
    user_rng = random.Random(user_seed)
    return system + [user_rng.randrange(3, 512) for _ in range(USER_TOKENS)]


def simulate(num_workers: int, policy: str, trace, cost: dict, seed: int) -> dict:
    rng = random.Random(seed)
    workers = [SimWorker(i) for i in range(num_workers)]
    index = EventIndex()
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)
    events: list[tuple[float, int, int, int]] = []  # (time, order, kind 0 arrival / 1 step, payload)
    for i, (at, _, _) in enumerate(trace):
        heapq.heappush(events, (at, i, 0, i))
    order = len(trace)
    arrived: dict[str, float] = {}
    # kv: the router's own view of each worker, from the requests it sent there (as Dynamo tracks them)
    routed: dict[str, tuple[int, int]] = {}  # request id -> (uncached prompt tokens, blocks)
    routed_prefill = np.zeros(num_workers)  # prompt tokens still to compute of requests routed to each worker
    routed_blocks = np.zeros(num_workers)  # blocks of routed, unfinished requests
    first_token: dict[str, float] = {}
    prompt_tokens = cached_tokens = output_tokens = 0
    next_rr = 0
    end_time = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == 0:
            _, prefix, user_seed = trace[payload]
            tokens = _prompt(prefix, user_seed)
            salt = f"tenant-{prefix // PROMPTS_PER_TENANT}".encode()
            if policy == "kv":
                hashes: list[bytes] = []
                extend_block_hashes(hashes, tokens, BLOCK_SIZE, salt)
                overlap = index.overlaps(hashes)
                num_blocks = -(-len(tokens) // BLOCK_SIZE)

                # potential prefill blocks + potential decode blocks, every worker at once
                costs = (routed_prefill + len(tokens)) / BLOCK_SIZE + routed_blocks + num_blocks
                for worker_id, blocks in overlap.items():
                    costs[worker_id] -= blocks
                ties = np.flatnonzero(costs == costs.min())
                worker = workers[int(ties[rng.randrange(len(ties))])]
            elif policy == "round_robin":
                worker, next_rr = workers[next_rr], (next_rr + 1) % num_workers
            else:
                worker = rng.choice(workers)
            request = Request(f"r{payload}", None, tokens, params, salt)
            if policy == "kv":
                new_tokens = len(tokens) - overlap.get(worker.worker_id, 0) * BLOCK_SIZE
                routed[request.request_id] = (new_tokens, num_blocks)
                routed_prefill[worker.worker_id] += new_tokens
                routed_blocks[worker.worker_id] += num_blocks
            seq = Sequence(request, 0, list(tokens), None)
            request.sequences.append(seq)
            worker.scheduler.add(seq)
            arrived[request.request_id] = now
            if not worker.busy:
                worker.busy = True
                order += 1
                heapq.heappush(events, (now, order, 1, worker.worker_id))
            continue
        worker = workers[payload]
        batch = worker.scheduler.schedule()
        if batch.is_empty:
            worker.busy = False
            continue
        done_at = now + step_cost(cost, batch)
        for seq, _, _ in worker.scheduler.advance(batch):
            request = seq.request
            tracked = routed.get(request.request_id)
            if request.request_id not in first_token:
                first_token[request.request_id] = done_at
                prompt_tokens += seq.num_prompt_tokens
                cached_tokens += request.num_cached_tokens or 0
                if tracked:
                    routed_prefill[worker.worker_id] -= tracked[0]  # mark_prefill_complete
            seq.append_token(7)
            output_tokens += 1
            if seq.num_output_tokens >= OUTPUT_TOKENS:
                worker.scheduler.finish(seq, "length")
                if tracked:
                    routed_blocks[worker.worker_id] -= tracked[1]  # free
                    del routed[request.request_id]
        index.apply(worker.worker_id, worker.kv.pool.kv_events)  # the events reach the router
        worker.kv.pool.kv_events = []
        end_time = max(end_time, done_at)
        order += 1
        heapq.heappush(events, (done_at, order, 1, worker.worker_id))
    ttfts = [first_token[r] - arrived[r] for r in first_token]
    return {"hit_rate": cached_tokens / prompt_tokens, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "output_tok_s": output_tokens / end_time,
            "requests": len(first_token)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.25, 1.5, 2.0],
                        help="offered load, in units of one worker's cold-cache capacity, per worker")
    parser.add_argument("--requests-per-worker", type=int, default=24)
    args = parser.parse_args()
    if args.quick:
        args.workers, args.loads, args.requests_per_worker = [16], [1.0], 12
    model, handle = common.random_llama_dir()
    log("calibrating the step cost model on this machine (the ~20M random Llama, float32)")
    cost = calibrate(model)
    log(f"cost model: {cost}")
    prefill = cost["a_s"] + cost["b_s_per_prefill_token"] * (SYSTEM_TOKENS + USER_TOKENS)  # one cold prompt, alone
    decode = cost["a_s"] / MAX_NUM_SEQS + cost["c_s_per_decode_seq"] + cost["d_s_per_context_token"] * SYSTEM_TOKENS
    one = prefill + OUTPUT_TOKENS * decode  # its share of a full decode batch per output token
    cold_capacity = 1.0 / one  # requests/s one worker finishes with no prefix hits, batching decodes
    log(f"one worker's cold-cache capacity: {cold_capacity:.2f} req/s")
    results = []
    for num_workers in args.workers:
        for load in args.loads:
            rate = load * cold_capacity * num_workers
            trace = make_trace(num_workers, args.requests_per_worker * num_workers, rate, seed=num_workers)
            for policy in POLICIES:
                start = time.perf_counter()
                run = simulate(num_workers, policy, trace, cost, seed=1)
                run.update(workers=num_workers, load=load, rate=rate, policy=policy,
                           wall_s=round(time.perf_counter() - start, 1))
                results.append(run)
                log(f"{num_workers:5d} workers load {load:.2f} {policy:12s} hit {run['hit_rate']:.1%} TTFT p50 "
                    f"{run['ttft_p50_s']:.2f} s p99 {run['ttft_p99_s']:.2f} s {run['output_tok_s']:.0f} tok/s "
                    f"({run['wall_s']} s)")
    capacity = {f"{n}/{p}": max([r["load"] for r in results if r["workers"] == n and r["policy"] == p
                                 and r["ttft_p99_s"] <= TTFT_SLO_S], default=0.0)
                for n in args.workers for p in POLICIES}
    write_result("fleet", args.quick, {
        "machine": machine_info(), "cost_model": cost, "cold_capacity_req_s_per_worker": cold_capacity,
        "workload": {"block_size": BLOCK_SIZE, "num_blocks_per_worker": NUM_BLOCKS, "max_num_seqs": MAX_NUM_SEQS,
                     "system_tokens": SYSTEM_TOKENS, "user_tokens": USER_TOKENS, "output_tokens": OUTPUT_TOKENS,
                     "prefixes_per_worker": PREFIXES_PER_WORKER, "zipf_s": ZIPF_S, "ttft_slo_s": TTFT_SLO_S,
                     "requests_per_worker": args.requests_per_worker},
        "capacity_load_under_slo": capacity, "runs": results})
    plot(results, args.workers, args.quick)
    del handle


def plot(results: list[dict], fleet_sizes: list[int], quick: bool) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(fleet_sizes), figsize=(4.2 * len(fleet_sizes), 6.5), squeeze=False)
    for col, n in enumerate(fleet_sizes):
        for policy in POLICIES:
            runs = sorted((r for r in results if r["workers"] == n and r["policy"] == policy), key=lambda r: r["load"])
            loads = [r["load"] for r in runs]
            axes[0][col].plot(loads, [r["ttft_p99_s"] for r in runs], marker="o", label=policy)
            axes[1][col].plot(loads, [r["hit_rate"] for r in runs], marker="o", label=policy)
        axes[0][col].axhline(TTFT_SLO_S, color="grey", linestyle=":", linewidth=1)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{n} simulated workers")
        axes[0][col].set_ylabel("TTFT p99 (s)")
        axes[1][col].set_ylabel("prefix hit rate")
        axes[1][col].set_xlabel("offered load (x one worker's cold capacity, per worker)")
        axes[0][col].legend(fontsize=8)
    common.save_figure(fig, "fleet", quick)


if __name__ == "__main__":
    main()
