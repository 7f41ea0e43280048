"""What a bulk body's priority costs it: a 100 KB /tokenize while 16 streams decode, at each bulk nice value.

    .venv/bin/python bench/bench_bulk_priority.py [--quick] [--repeats N]

A real `pagedserve serve` (SmolLM2's Q4_1 GGUF) per setting of server.preprocessing_bulk_nice
(0, 10, 19), alternated: tenant B keeps 16 completions of 200 tokens decoding (EOS ignored, a
new one when one ends), and after 3 s tenant A sends a 103,200-byte prompt to /tokenize eight
times, 0.5 s apart. Reported: the median and largest /tokenize latency per setting (median over
repeats). The other side of the trade, a flood's effect on another tenant's chats, is
bench_tenant_flood.py. Results: bench/results/bulk_priority.json; BENCHMARKS.md section 26.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import bench_tenant_flood as flood
from common import (REPO, alternated, free_port, log, machine_info, median, quick_mode, start_process, stop_process,
                    wait_for_quiet, wait_http, write_result)

from tests.service.conftest import write_tenants_file  # noqa: E402

NICES = (0, 10, 19)
STREAMS, STREAM_TOKENS = 16, 200
PROMPT = "the cat sat on the mat. " * 4300  # 103,200 bytes: bulk work (>= 64 KiB)
PROBES, PROBE_EVERY_S = 8, 0.5


async def _probe(url: str) -> list[float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        model = await flood._model_id(session, url)
        stop = False

        async def stream():
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
            while not stop:
                async with session.post(url + "/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {flood.KEY_B}"}) as response:
                    await response.read()

        load = [asyncio.ensure_future(stream()) for _ in range(STREAMS)]
        await asyncio.sleep(3.0)  # decoding in full swing
        latencies = []
        for _ in range(PROBES):
            start = time.perf_counter()
            async with session.post(url + "/tokenize", json={"prompt": PROMPT},
                                    headers={"Authorization": f"Bearer {flood.KEY_A}"}) as response:
                await response.read()
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(PROBE_EVERY_S)
        stop = True
        await asyncio.gather(*load)
        return latencies


def _run(model: str, nice: int, folder: Path) -> dict:
    tenants = write_tenants_file(folder / "tenants.toml", {"a": {"keys": [flood.KEY_A], "plan": "standard"},
                                                           "b": {"keys": [flood.KEY_B], "plan": "standard"}})
    port = free_port()
    proc = start_process([str(REPO / ".venv" / "bin" / "python"), "-m", "service.cli", "serve", "--model", model,
                          "--port", str(port), "--data-dir", str(folder), "--tenants", str(tenants)],
                         env={"PAGEDSERVE_SERVER_PREPROCESSING_BULK_NICE": str(nice)}, log_path=folder / "server.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", proc, 300, folder / "server.log")
        latencies = asyncio.run(_probe(f"http://127.0.0.1:{port}"))
    finally:
        stop_process(proc)
    return {"median_s": median(latencies), "max_s": max(latencies), "latencies_s": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: SmolLM2's Q4_1 GGUF (bench/smollm2.py)")
    args = parser.parse_args()
    quick_mode(args.quick)
    repeats = 1 if args.quick else args.repeats
    if args.model is None:
        from smollm2 import gguf_file

        args.model = str(gguf_file())
    runs: dict[str, list[dict]] = {str(nice): [] for nice in NICES}
    with tempfile.TemporaryDirectory(prefix="bulk-priority-") as tmp:
        for i, (r, nice) in enumerate(alternated([str(n) for n in NICES], repeats), 1):
            folder = Path(tmp) / f"{nice}-{r}"
            folder.mkdir()
            background = wait_for_quiet()
            result = _run(args.model, int(nice), folder) | {"background_cpu_pct": background}
            runs[nice].append(result)
            log(f"bulk nice {nice}, repeat {r + 1}/{repeats} ({i}/{len(NICES) * repeats}): 100 KB /tokenize "
                f"median {result['median_s']:.3f}s, max {result['max_s']:.3f}s")
    summary = {nice: {"median_s": median([run["median_s"] for run in rows]),
                      "max_s": median([run["max_s"] for run in rows])} for nice, rows in runs.items()}
    log(f"summary: {summary}")
    path = write_result("bulk_priority", args.quick, {"machine": machine_info(), "model": args.model,
                                                      "streams": STREAMS, "prompt_bytes": len(PROMPT),
                                                      "summary": summary, "runs": runs})
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
