"""One-GPU check of the Triton kernels: the kernel tests on CUDA, then decode and KV-write timings.

    bench/gpu_check.sh                      # the whole check, under 5 minutes on one H200
    python bench/gpu_check.py --skip-tests  # timings only
    TRITON_INTERPRET=1 python bench/gpu_check.py --smoke   # tiny shapes on the CPU: checks this script

1. pytest tests/kernels with TRITON_INTERPRET=0, so every `cuda` case runs compiled kernels.
2. Paged decode attention, Llama-3-8B heads (32 query heads, 8 KV heads, head_dim 128,
   pages of 16 tokens), bfloat16, over (batch, context) = (1, 32k), (16, 4k), (64, 2k),
   (256, 1k): achieved bandwidth (bytes read / time) against a device-to-device copy
   measured in the same run, and the time over torch's scaled_dot_product_attention on the
   same K/V laid out contiguously.
3. The KV write, one launch per layer, against the reference's index_copy_.

Times are medians of triton.testing.do_bench (L2 flushed between runs). Results:
bench/results/gpu_check_<gpu>_<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULTS = REPO / "bench" / "results"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B attention
DECODE_GRID = [(1, 32768), (16, 4096), (64, 2048), (256, 1024)]  # (batch, context)
KV_WRITE_TOKENS = [256, 8192]  # a decode step's tokens, a prefill batch's
TESTS_TIMEOUT_S = 200
SMOKE_DECODE_GRID = [(1, 96), (3, 48)]
SMOKE_KV_WRITE_TOKENS = [5]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def time_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn(): do_bench on CUDA (L2 flushed between runs), a plain loop elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def run_tests() -> dict:
    """pytest tests/kernels on CUDA (compiled kernels), streamed; returns its exit code and summary."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env.setdefault("PAGEDSERVE_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") % 2**31))
    # -q comes from pyproject; a module that cannot import (a missing dependency) fails alone
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-rs", "--durations=10", "--continue-on-collection-errors"]
    try:
        import xdist  # noqa: F401

        cmd += ["-n", str(min(8, os.cpu_count() or 1))]  # compiles in parallel
    except ImportError:
        pass
    log(f"kernel tests: {' '.join(cmd[2:])} (PAGEDSERVE_TEST_SEED={env['PAGEDSERVE_TEST_SEED']})")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    timer = threading.Timer(TESTS_TIMEOUT_S, proc.kill)  # leave time for the timings
    timer.start()
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    returncode = proc.wait()
    timer.cancel()
    if returncode == -9:
        lines.append(f"killed after {TESTS_TIMEOUT_S} s")
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|error)|killed", line)), "")
    log(f"kernel tests: exit {returncode} in {time.perf_counter() - start:.0f} s: {summary.strip('= ')}")
    return {"exit_code": returncode, "summary": summary.strip("= "), "seed": env["PAGEDSERVE_TEST_SEED"],
            "seconds": round(time.perf_counter() - start, 1)}


def copy_bandwidth(device: torch.device, num_bytes: int) -> dict:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return {"bytes": num_bytes, "ms": round(ms, 4), "read_plus_write_GBps": round(2 * num_bytes / ms / 1e6, 1)}


def paged_decode_problem(batch: int, context: int, device: torch.device, dtype: torch.dtype, seed: int):
    """The same K/V twice: contiguous [batch, kv_heads, context, head_dim] for SDPA, and scattered
    into shuffled pages [num_blocks, block_size, kv_heads, head_dim] with a block table."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = context // BLOCK_SIZE
    num_blocks = batch * pages_per_seq
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    keys = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    values = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    block_tables = torch.randperm(num_blocks, device=device, generator=gen).view(batch, pages_per_seq).int()
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    pages = block_tables.reshape(-1).long()
    # [batch, kv, ctx, d] -> [batch * pages_per_seq, block_size, kv, d], page j of seq b at pages[b * pps + j]
    k_cache[pages] = keys.transpose(1, 2).reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache[pages] = values.transpose(1, 2).reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, keys, values, k_cache, v_cache, block_tables, context_lens


def sdpa_decode(q, keys, values, scale, backends):
    """Contiguous decode attention through torch SDPA, restricted to `backends` (None: torch's choice)."""
    from torch.nn.attention import sdpa_kernel

    def attend():
        return F.scaled_dot_product_attention(q[:, :, None, :], keys, values, scale=scale, enable_gqa=True)[:, :, 0, :]

    if backends is None:
        return attend()
    with sdpa_kernel(backends):
        return attend()


def sdpa_backends_that_run(q, keys, values, scale):
    """Flash attention if SDPA takes these shapes with it, else torch's own choice (recorded)."""
    from torch.nn.attention import SDPBackend

    try:
        sdpa_decode(q, keys, values, scale, [SDPBackend.FLASH_ATTENTION])
        return [SDPBackend.FLASH_ATTENTION], "flash"
    except RuntimeError:
        return None, "default"


def bench_decode(grid, device, dtype, copy_GBps: float) -> list[dict]:
    rows = []
    scale = HEAD_DIM**-0.5
    for batch, context in grid:
        log(f"decode batch={batch} context={context}: building {batch * context} tokens of paged K/V")
        problem = paged_decode_problem(batch, context, device, dtype, seed=batch)
        q, keys, values, k_cache, v_cache, tables, lens = problem

        def paged():
            return kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, backend="triton")

        out = paged()
        backends, sdpa_name = sdpa_backends_that_run(q, keys, values, scale)
        expected = sdpa_decode(q, keys, values, scale, backends)
        max_err = (out.float() - expected.float()).abs().max().item()
        paged_ms = time_ms(paged, device)
        sdpa_ms = time_ms(lambda: sdpa_decode(q, keys, values, scale, backends), device)
        elem = torch.finfo(dtype).bits // 8
        kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
        bytes_read = kv_bytes + q.numel() * elem + tables.numel() * 4 + lens.numel() * 4
        GBps = bytes_read / paged_ms / 1e6
        row = {
            "batch": batch, "context": context, "bytes_read": bytes_read,
            "paged_ms": round(paged_ms, 4), "sdpa_ms": round(sdpa_ms, 4),
            "paged_over_sdpa": round(paged_ms / sdpa_ms, 3),
            "paged_GBps": round(GBps, 1), "paged_fraction_of_copy_bw": round(GBps / copy_GBps, 3),
            "sdpa_GBps": round(bytes_read / sdpa_ms / 1e6, 1), "sdpa_backend": sdpa_name,
            "max_abs_diff_vs_sdpa": max_err,
        }
        log(f"  paged {paged_ms:.3f} ms = {GBps:.0f} GB/s ({100 * GBps / copy_GBps:.0f}% of copy), "
            f"SDPA ({sdpa_name}) {sdpa_ms:.3f} ms, paged/SDPA {paged_ms / sdpa_ms:.2f}, max |diff| {max_err:.2e}")
        rows.append(row)
        del problem, q, keys, values, k_cache, v_cache, tables, lens, out, expected
    return rows


def bench_kv_write(token_counts, device, dtype) -> list[dict]:
    rows = []
    num_blocks = 8192 if device.type == "cuda" else 8
    for num_tokens in token_counts:
        gen = torch.Generator(device=device).manual_seed(num_tokens)
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
        value = torch.randn_like(key)
        k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device, generator=gen)[:num_tokens]  # int64

        def triton_write():
            kernels.write_kv(key, value, k_cache, v_cache, slots, backend="triton")

        triton_write()
        expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        reference.write_kv(key, value, expected_k, expected_v, slots)
        exact = bool(torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v))
        triton_ms = time_ms(triton_write, device)
        torch_ms = time_ms(lambda: reference.write_kv(key, value, k_cache, v_cache, slots), device)
        moved = 2 * 2 * key.numel() * key.element_size()  # K and V, read and written
        row = {"num_tokens": num_tokens, "triton_ms": round(triton_ms, 4), "torch_index_copy_ms": round(torch_ms, 4),
               "triton_GBps": round(moved / triton_ms / 1e6, 1), "equal_to_reference": exact}
        log(f"kv write {num_tokens} tokens: triton {triton_ms * 1e3:.1f} us, index_copy_ {torch_ms * 1e3:.1f} us, "
            f"exact {exact}")
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="timings only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.smoke:
        device, dtype, grid, write_tokens, copy_bytes = torch.device("cpu"), torch.float32, SMOKE_DECODE_GRID, \
            SMOKE_KV_WRITE_TOKENS, 1 << 20
        args.skip_tests = True
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --smoke to check this script on the CPU)", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "0"
        device, dtype, grid, write_tokens, copy_bytes = torch.device("cuda"), torch.bfloat16, DECODE_GRID, \
            KV_WRITE_TOKENS, 2 << 30
    started = time.perf_counter()
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "heads": {"num_q_heads": NUM_Q_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE},
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    if not args.skip_tests:
        result["tests"] = run_tests()
    log("device-to-device copy bandwidth")
    result["copy"] = copy_bandwidth(device, copy_bytes)
    log(f"  copy: {result['copy']['read_plus_write_GBps']:.0f} GB/s (read + write)")
    result["decode"] = bench_decode(grid, device, dtype, result["copy"]["read_plus_write_GBps"])
    result["kv_write"] = bench_kv_write(write_tokens, device, dtype)
    result["seconds"] = round(time.perf_counter() - started, 1)
    folder = Path(tempfile.gettempdir()) if args.smoke else RESULTS  # smoke results are not results
    folder.mkdir(parents=True, exist_ok=True)
    name = "smoke" if args.smoke else re.sub(r"[^a-z0-9]+", "-", result["device"].lower()).strip("-")
    path = folder / f"gpu_check_{name}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path} after {result['seconds']} s")
    failed = result.get("tests", {}).get("exit_code", 0) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
