"""One tenant floods the server with big bodies; another tenant's chat latency and /health, alone vs during it.

    .venv/bin/python bench/bench_tenant_flood.py [--quick] [--repeats N] [--model PATH] [--baseline-ref REF]
                                                 [--phases tokenize,oversize,slowloris]

A real `pagedserve serve` (SmolLM2's Q4_1 GGUF by default) with two tenants, A and B. In each
phase, tenant A sends one-token chats one after another ("hi", max_tokens 1) and a prober
GETs /health every 20 ms, for PHASE_S seconds. Phases:

alone      nothing else runs
tokenize   tenant B keeps 16 POST /tokenize of a 1 MB prompt (1,032,000 bytes) in flight (each a new one when one ends)
oversize   tenant B keeps 16 chats of the same 1 MB as a message in flight (each refused: context_length_exceeded)
slowloris  500 sockets from 127.0.0.2 each send a request head one byte a second (for SLOWLORIS_S, longer than
           the server's 15 s idle_timeout_s): how many the server closed, and how long each was held

Tenant B runs in a process of its own, so its uploads and reads never delay A's client; all share the 2 cores.
Run alternated (alone tokenize oversize, then reversed, ...), --repeats times. Reported per
phase: A's chat latency p50 / p99, /health p50 / p99, B's requests answered, and the goals'
ratios: A's p99 during a flood over A's p99 alone (goal <= 1.5), /health p99 during a flood
(goal <= 50 ms). With --baseline-ref, the same phases also run against a git worktree of that
commit (the server as it was before preprocessing left the event loop), alternated with this
one, so the before and after are measured side by side. Results: bench/results/tenant_flood.json;
BENCHMARKS.md section "Tenant isolation".
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from common import (REPO, alternated, free_port, log, machine_info, median, percentile, quick_mode, start_process,
                    stop_process, wait_for_quiet, wait_http, write_result)

from tests.service.conftest import write_tenants_file  # noqa: E402

KEY_A, KEY_B = "sk-bench-a", "sk-bench-b"
FLOOD_IN_FLIGHT = 16
FLOOD_REPEATS = 43_000  # "the cat sat on the mat. " x 43,000: 1,032,000 bytes, under the 1 MiB body limit
PROBE_EVERY_S = 0.02
PHASES = ("alone", "tokenize", "oversize", "slowloris")
SLOWLORIS_SOCKETS, SLOWLORIS_FROM, SLOWLORIS_S = 500, "127.0.0.2", 20.0


def _flood_bodies() -> dict[str, bytes]:
    import json

    text = "the cat sat on the mat. " * FLOOD_REPEATS
    return {"tokenize": json.dumps({"prompt": text}).encode(),
            "oversize": json.dumps({"model": "{model}", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}).encode()}


FLOOD_PATHS = {"tokenize": "/tokenize", "oversize": "/v1/chat/completions"}


async def _model_id(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}) as response:
        return (await response.json())["data"][0]["id"]


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        return await _model_id(session, url)


async def _chats(session: aiohttp.ClientSession, url: str, model: str, stop_at: float) -> list[float]:
    latencies = []
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {KEY_A}"}) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"tenant A's chat answered {response.status}")
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)
    return latencies


async def _probe(session: aiohttp.ClientSession, url: str, stop_at: float) -> list[float]:
    latencies = []
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        async with session.get(url + "/health") as response:
            await response.read()
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(PROBE_EVERY_S)
    return latencies


async def _flood_worker(session: aiohttp.ClientSession, url: str, body: bytes, stop_at: float, answered: list[int]) -> None:
    headers = {"Authorization": f"Bearer {KEY_B}", "Content-Type": "application/json"}
    while time.monotonic() < stop_at:
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            answered.append(response.status)


async def _slow_head(host: str, port: int, stop_at: float) -> float | None:
    """A head sent a byte a second until the server closes the socket: seconds it was held, or None (still open,
    or refused before the connection was made)."""
    try:
        reader, writer = await asyncio.open_connection(host, port, local_addr=(SLOWLORIS_FROM, 0))
    except OSError:
        return None
    opened = time.monotonic()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    try:
        for i in range(len(head)):
            if time.monotonic() >= stop_at:
                return None
            writer.write(head[i: i + 1])
            try:
                if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                    return time.monotonic() - opened
            except asyncio.TimeoutError:
                continue
        return None
    except (ConnectionError, OSError):
        return time.monotonic() - opened
    finally:
        writer.close()


async def _attack(url: str, phase: str, body: bytes, stop_at: float) -> dict:
    """Tenant B's side of a phase until `stop_at`: the flood's statuses, or how long each slow head was held."""
    if phase == "slowloris":
        host, port = url.removeprefix("http://").split(":")
        return {"held": await asyncio.gather(*(_slow_head(host, int(port), stop_at) for _ in range(SLOWLORIS_SOCKETS)))}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=FLOOD_IN_FLIGHT)) as session:
        answered: list[int] = []
        await asyncio.gather(*(_flood_worker(session, url + FLOOD_PATHS[phase], body, stop_at, answered)
                               for _ in range(FLOOD_IN_FLIGHT)))
    return {"answered": answered}


def _attacker(url: str, phase: str, body: bytes, stop_at: float, results: multiprocessing.Queue) -> None:
    """A process of its own, so that B's uploads and reads never delay A's client (both share the machine)."""
    results.put(asyncio.run(_attack(url, phase, body, stop_at)))


async def _victim(url: str, model: str, phase_s: float) -> tuple[list[float], list[float]]:
    """Tenant A's chats and the /health prober for `phase_s` seconds: their latencies."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=4)) as session:
        stop_at = time.monotonic() + phase_s
        return await asyncio.gather(_chats(session, url, model, stop_at), _probe(session, url, stop_at))


def _phase(url: str, phase: str, bodies: dict[str, bytes], model: str, phase_s: float) -> dict:
    held: list[float | None] = []
    answered: list[int] = []
    attacker = None
    if phase != "alone":
        results = multiprocessing.get_context("fork").Queue()
        measured_s = SLOWLORIS_S if phase == "slowloris" else phase_s
        body = bodies.get(phase, b"").replace(b"{model}", model.encode())
        # B starts a second early (the flood in full swing before A is measured) and ends after A
        stop_at = time.monotonic() + measured_s + (4.0 if phase == "slowloris" else 2.0)
        attacker = multiprocessing.get_context("fork").Process(target=_attacker, args=(url, phase, body, stop_at, results))
        attacker.start()
        time.sleep(1.0)
        phase_s = measured_s
    chats, health = asyncio.run(_victim(url, model, phase_s))
    if attacker is not None:
        outcome = results.get(timeout=600)
        attacker.join(60)
        held, answered = outcome.get("held", []), outcome.get("answered", [])
    statuses = sorted(set(answered))
    closed = [s for s in held if s is not None]
    slow_stats = {"slow_sockets": len(held), "slow_closed": len(closed), "slow_held_max_s": max(closed, default=0.0),
                  "slow_held_p50_s": median(closed)} if held else {}
    return {"a_chat_p50_s": median(chats), "a_chat_p99_s": percentile(chats, 0.99), "a_chats": len(chats),
            "health_p50_ms": 1000 * median(health), "health_p99_ms": 1000 * percentile(health, 0.99),
            "b_answered": len(answered), "b_statuses": statuses, **slow_stats}


def _worktree(ref: str, folder: Path) -> Path:
    path = folder / "baseline-checkout"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref], check=True,
                   capture_output=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="default: SmolLM2's Q4_1 GGUF (bench/smollm2.py)")
    parser.add_argument("--baseline-ref", default=None, help="also measure this commit, side by side")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated, from {', '.join(PHASES)} (alone is always run: the ratios need it)")
    args = parser.parse_args()
    phases = ("alone", *(p for p in PHASES[1:] if p in args.phases.split(",")))
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    quick_mode(args.quick)
    repeats, phase_s = (1, 3.0) if args.quick else (args.repeats, args.phase_s)
    if args.model is None:
        from smollm2 import gguf_file

        args.model = str(gguf_file())
    bodies = _flood_bodies()
    with tempfile.TemporaryDirectory(prefix="tenant-flood-") as tmp:
        folder = Path(tmp)
        servers = {"now": REPO}
        if args.baseline_ref:
            servers["baseline"] = _worktree(args.baseline_ref, folder)
        procs, urls, models = {}, {}, {}
        try:
            for name, repo in servers.items():
                (folder / name).mkdir()
                port = free_port()
                log(f"starting {name} server ({repo}) on port {port}")
                procs[name] = start_process(
                    [str(REPO / ".venv" / "bin" / "python"), "-m", "service.cli", "serve", "--model", args.model,
                     "--port", str(port), "--data-dir", str(folder / name), "--tenants",
                     str(write_tenants_file(folder / name / "tenants.toml",
                                            {"a": {"keys": [KEY_A], "plan": "standard"},
                                             "b": {"keys": [KEY_B], "plan": "standard"}}))],
                    log_path=folder / name / "server.log", cwd=repo)
                urls[name] = f"http://127.0.0.1:{port}"
                wait_http(urls[name] + "/ready", procs[name], timeout=300, log_path=folder / name / "server.log")
                models[name] = asyncio.run(_served_model(urls[name]))
            runs: dict[str, dict[str, list[dict]]] = {name: {phase: [] for phase in phases} for name in servers}
            plan = [(r, name, phase) for r, name in alternated(list(servers), repeats)
                    for phase in (phases if r % 2 == 0 else tuple(reversed(phases)))]
            for i, (r, name, phase) in enumerate(plan, 1):
                background = wait_for_quiet()
                result = _phase(urls[name], phase, bodies, models[name], phase_s)
                result["background_cpu_pct"] = background
                runs[name][phase].append(result)
                log(f"{name} {phase} repeat {r + 1}/{repeats} ({i}/{len(plan)}): A p99 {result['a_chat_p99_s']:.3f}s "
                    f"/health p99 {result['health_p99_ms']:.1f}ms, B answered {result['b_answered']} "
                    f"{result['b_statuses']}" + (f", slow heads closed {result['slow_closed']}/{result['slow_sockets']}"
                                                 f" (held at most {result['slow_held_max_s']:.1f}s)"
                                                 if "slow_sockets" in result else ""))
        finally:
            for proc in procs.values():
                stop_process(proc)
            if args.baseline_ref:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(servers["baseline"])],
                               capture_output=True)
    summary = {}
    for name in servers:
        alone_p99 = median([run["a_chat_p99_s"] for run in runs[name]["alone"]])
        summary[name] = {"a_chat_p99_alone_s": alone_p99}
        for phase in phases[1:]:
            flood_p99 = median([run["a_chat_p99_s"] for run in runs[name][phase]])
            summary[name][phase] = {
                "a_chat_p99_s": flood_p99, "a_chat_p99_ratio": flood_p99 / alone_p99,
                "health_p99_ms": median([run["health_p99_ms"] for run in runs[name][phase]]),
                "b_answered": median([run["b_answered"] for run in runs[name][phase]])}
            if phase == "slowloris":
                summary[name][phase] |= {key: max(run[key] for run in runs[name][phase])
                                         for key in ("slow_held_max_s",)} | {
                    key: min(run[key] for run in runs[name][phase]) for key in ("slow_closed",)}
        log(f"{name}: {summary[name]}")
    name = "tenant_flood" if phases == PHASES else "tenant_flood_" + "_".join(phases[1:])
    path = write_result(name, args.quick, {
        "machine": machine_info(), "model": args.model, "phase_s": phase_s, "repeats": repeats, "phases": phases,
        "flood": {"in_flight": FLOOD_IN_FLIGHT, "body_bytes": len(bodies["tokenize"])}, "baseline_ref": args.baseline_ref,
        "goals": {"a_chat_p99_ratio": 1.5, "health_p99_ms": 50}, "summary": summary, "runs": runs})
    log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
