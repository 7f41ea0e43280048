"""Pieces every benchmark shares: paths, pinned threads, models, servers, statistics, output.

Conventions (BENCHMARKS.md): every figure is measured side by side with its peer in one
run, systems alternated (A B, B A, A B, ...), the median of the repeats reported; seeds
are fixed; torch uses `TORCH_THREADS` threads (2 by default: this machine's cores).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STORIES = REPO.parent / "shared" / "models" / "stories260K"
RESULTS = REPO / "bench" / "results"
TORCH_THREADS = int(os.environ.get("BENCH_TORCH_THREADS", "2"))
_START = time.monotonic()


def log(message: str) -> None:
    """A progress line on stderr with the seconds since this script started."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


def quick_mode(quick: bool) -> None:
    """A --quick smoke run does not wait for a quiet machine."""
    if quick:
        os.environ.setdefault("BENCH_QUIET_WAIT_S", "0")


def pin_threads(seed: int = 0) -> None:
    """Fixed torch thread count and seeds, before anything is measured."""
    import torch

    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(seed)


def machine_info() -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
        info["cpu_flags"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    except OSError:
        pass
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


# --- models and prompts -----------------------------------------------------------------


def make_random_llama(path: Path, *, hidden_size: int = 512, intermediate_size: int = 1408, num_layers: int = 7,
                      num_heads: int = 8, num_kv_heads: int = 4, max_position_embeddings: int = 1024,
                      tokenizer_dir: Path = STORIES) -> Path:
    """A Llama with random weights (~20M parameters by default) and stories260K's tokenizer (or another
    tokenizer folder's: the vocabulary is then its size, the end token its eos_token)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = json.loads((tokenizer_dir / "tokenizer_config.json").read_text()).get("eos_token")
    eos_id = tokenizer.token_to_id(eos if isinstance(eos, str) else eos["content"]) if eos else 2
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, bos_token_id=1, eos_token_id=eos_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def random_llama_dir() -> tuple[Path, tempfile.TemporaryDirectory]:
    """The ~20M random Llama in a temporary folder (keep the handle alive while it is used)."""
    tmp = tempfile.TemporaryDirectory(prefix="bench-llama20m-")
    return make_random_llama(Path(tmp.name) / "llama-20m"), tmp


def num_parameters(model_dir: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for file in model_dir.glob("*.safetensors") for t in load_file(file).values())


def make_prompts(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """Token-id prompts: BOS then uniform random ids in [3, 512), lengths uniform in [min_len, max_len]."""
    import random

    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 512) for _ in range(rng.randint(min_len, max_len) - 1)] for _ in range(num)]


# --- statistics -------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1] (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def alternated(systems: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, system) in the order they run: A B, then B A, then A B, ..."""
    order = []
    for r in range(repeats):
        names = list(systems) if r % 2 == 0 else list(reversed(systems))
        order += [(r, name) for name in names]
    return order


def wait_for_quiet(max_wait_s: float | None = None, busy_pct: float = 30) -> float:
    """Wait (up to `max_wait_s`) until the machine's CPU use, sampled while we are idle, is under `busy_pct`.

    The machine may be shared (tests of another checkout); a run that starts while it is
    busy is slower for reasons that have nothing to do with the system measured. Returns
    the CPU use seen last, which the results record. The wait defaults to
    $BENCH_QUIET_WAIT_S (60 s; --quick runs set 0).
    """
    import psutil

    if max_wait_s is None:
        max_wait_s = float(os.environ.get("BENCH_QUIET_WAIT_S", "60"))
    deadline = time.monotonic() + max_wait_s
    busy = psutil.cpu_percent(interval=0.5)
    waited = False
    while busy > busy_pct and time.monotonic() < deadline:
        if not waited:
            log(f"machine busy ({busy:.0f}% CPU from other processes), waiting up to {max_wait_s:.0f}s")
            waited = True
        busy = psutil.cpu_percent(interval=2)
    return busy


def run_alternated(systems: dict[str, Callable[[], dict]], repeats: int, label: str) -> dict[str, list[dict]]:
    """Call each system's run function `repeats` times, alternating; returns every run per system.

    Each run starts once the machine is quiet (wait_for_quiet); the CPU use seen just before
    it is kept in the run's result as `background_cpu_pct`.
    """
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    plan = alternated(list(systems), repeats)
    for i, (r, name) in enumerate(plan, 1):
        background = wait_for_quiet()
        start = time.perf_counter()
        result = systems[name]()
        result["background_cpu_pct"] = background
        runs[name].append(result)
        log(f"{label}: {name} repeat {r + 1}/{repeats} ({i}/{len(plan)}) {time.perf_counter() - start:.1f}s "
            f"{_short(result)}")
    return runs


def _short(result: dict) -> str:
    keys = [k for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:4]
    return " ".join(f"{k}={result[k]:.4g}" for k in keys)


def median_of(runs: list[dict], key: str) -> float:
    return median([run[key] for run in runs])


# --- servers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(argv: list[str], env: dict | None = None, log_path: Path | None = None,
                  cwd: Path = REPO) -> subprocess.Popen:
    """Start a server process in its own process group (so stop_process ends its children too)."""
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL
    return subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | (env or {}),
                            start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120, log_path: Path | None = None) -> None:
    """Wait until GET `url` answers 200; raise with the process's log tail if it exits or times out."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError(f"server at {url} not ready after {timeout}s: {tail(log_path)}")


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def cpu_seconds(pids: Sequence[int]) -> list[float]:
    """User + system CPU seconds so far of each pid's session (a server and its workers, or a client)."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = dict.fromkeys(pids, 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        session = int(fields[3])  # field 6 of stat
        if session in totals:
            totals[session] += int(fields[11]) + int(fields[12])  # utime, stime
    return [totals[pid] / tick for pid in pids]


class CpuSampler:
    """Samples the CPU seconds of some process sessions 20 times a second, to read any window afterwards."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.samples: list[tuple[float, list[float]]] = []  # (monotonic time, CPU seconds per pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), cpu_seconds(self.pids)))
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic(), cpu_seconds(self.pids)))

    def window(self, start: float, end: float) -> list[float]:
        """CPU seconds each session spent between two monotonic times (nearest samples inside)."""
        inside = [cpu for t, cpu in self.samples if start <= t <= end]
        if len(inside) < 2:
            return [0.0] * len(self.pids)
        return [b - a for a, b in zip(inside[0], inside[-1])]


def tail(path: Path | None, num_chars: int = 2000) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-num_chars:]


# --- output -----------------------------------------------------------------------------


def result_path(name: str, quick: bool, suffix: str = "json") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / (f"{name}_quick.{suffix}" if quick else f"{name}.{suffix}")


def write_result(name: str, quick: bool, result: dict) -> Path:
    path = result_path(name, quick)
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path.relative_to(REPO)}")
    return path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str, quick: bool) -> Path:
    path = result_path(name, quick, "png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path.relative_to(REPO)}")
    return path


def timed(fn, box: list[float]):
    """`fn`, adding the seconds each call takes to box[0] (to time a part of a step in place)."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            box[0] += time.perf_counter() - start

    return wrapper


def read_bandwidth_gbs(buffer_mib: int = 512, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in GB/s, STREAM-like: the best of `repeats` float32 sums over
    a buffer far past the last-level cache, on torch's threads (the decode kernels' own threads)."""
    import torch

    buffer = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)  # touched once: pages mapped before timing
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def time_ms(fn, iters: int) -> float:
    """Milliseconds per call of `fn`, over `iters` calls after one untimed call."""
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1000
