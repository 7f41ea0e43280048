"""Starting is all or nothing: every serving command fails fast, with one line naming the cause (real processes)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import requests

from service.startup import StartupError, bind_port, check_discovery_dir, check_model_path
from tests.processes import REPO, Process



def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str, float]:
    """(exit status, stdout + stderr, seconds) of `python -m service.cli ARGS`."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def _one_error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output and "FATAL" not in output, output
    return lines[0]


@pytest.fixture()
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_bind_port_names_a_taken_port(taken_port):
    with pytest.raises(StartupError, match=f"port {taken_port} on 127.0.0.1 is already in use"):
        bind_port("127.0.0.1", taken_port)
    sock = bind_port("127.0.0.1", 0)
    assert sock.getsockname()[1] > 0
    sock.close()


def test_path_checks_name_the_path(tmp_path):
    with pytest.raises(StartupError, match="does not exist"):
        check_model_path(str(tmp_path / "missing"))
    with pytest.raises(StartupError, match="no config.json"):
        check_model_path(str(tmp_path))
    check_model_path("demo")
    (tmp_path / "model.bin").write_text("")
    with pytest.raises(StartupError, match="not a .gguf file"):
        check_model_path(str(tmp_path / "model.bin"))
    (tmp_path / "model.gguf").write_text("")
    check_model_path(str(tmp_path / "model.gguf"))  # its contents are checked when it loads, with the file named
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match="not writable"):
        check_discovery_dir(str(tmp_path / "file" / "discovery"))
    assert check_discovery_dir(str(tmp_path / "discovery")).is_dir()


def test_serve_on_a_taken_port_exits_before_loading_the_model(stories_dir, taken_port):
    code, output, seconds = _run("serve", "--model", str(stories_dir), "--port", str(taken_port))
    assert code == 1
    assert f"port {taken_port}" in _one_error_line(output) and "loading model" not in output


def test_serve_with_a_wrong_model_path_says_so(tmp_path):
    code, output, _ = _run("serve", "--model", str(tmp_path / "nothing-here"), "--port", "0")
    assert code == 1 and "nothing-here does not exist" in _one_error_line(output)


def test_a_worker_with_a_bad_discovery_folder_or_model_says_so_and_registers_nothing(tmp_path, stories_dir):
    (tmp_path / "file").write_text("")
    code, output, _ = _run("worker", "--model", str(stories_dir), "--discovery-dir", str(tmp_path / "file" / "d"))
    assert code == 1 and "discovery folder" in _one_error_line(output)
    code, output, _ = _run("worker", "--model", str(tmp_path / "absent"), "--discovery-dir", str(tmp_path / "d"))
    assert code == 1 and "absent does not exist" in _one_error_line(output)
    assert not list((tmp_path / "d").rglob("*%2F*"))  # no instance, model card or event channel left behind


def test_a_front_door_fails_fast_on_a_taken_port_and_says_when_no_worker_came(tmp_path, stories_dir, taken_port):
    flags = ("serve", "--router", "dynamo", "--model", str(stories_dir), "--discovery-dir", str(tmp_path / "d"),
             "--data-dir", str(tmp_path / "data"))
    code, output, seconds = _run(*flags, "--port", str(taken_port), env={"PAGEDSERVE_DISTRIBUTED_WORKER_TIMEOUT_S": "30"})
    assert code == 1 and f"port {taken_port}" in _one_error_line(output) and seconds < 30  # before waiting for workers
    code, output, _ = _run(*flags, "--port", "0", env={"PAGEDSERVE_DISTRIBUTED_WORKER_TIMEOUT_S": "1"})
    assert code == 1 and "no pagedserve worker answered" in _one_error_line(output)


def test_a_worker_without_a_port_takes_a_free_one_and_prints_it(tmp_path, stories_dir):
    worker = Process("worker", ["worker", "--model", str(stories_dir), "--discovery-dir", str(tmp_path / "d"),
                                "--num-blocks", "32"], 0, tmp_path, {})
    try:
        said = None
        deadline = time.monotonic() + 90
        while said is None and time.monotonic() < deadline and worker.process.poll() is None:
            said = re.search(r"probes at http://127\.0\.0\.1:(\d+)", worker.tail(50_000))
            time.sleep(0.1)
        assert said, worker.tail()
        port = int(said.group(1))
        assert port not in (0, 8000)
        response = requests.get(f"http://127.0.0.1:{port}/ready", timeout=5)
        assert response.status_code == 200 and response.json() == {"status": "ready"}
    finally:
        worker.stop()


def test_the_server_does_not_load_torchs_compiler(smollm2_gguf):
    """The serving modules, loading a GGUF file and decoding leave torch's compiler stack (dynamo, inductor)
    unloaded: it costs every server process ~200 MB (llguidance.torch compiles a function at import; a
    model built on the meta device ran torch's Python meta kernels for its rope tables)."""
    script = ("import sys, service.app, service.cli, runtime.grammar\n"
              "from runtime.engine import Engine\n"
              "from runtime.sampling_params import SamplingParams\n"
              f"engine = Engine.from_pretrained({str(smollm2_gguf)!r}, num_blocks=32, block_size=16)\n"
              "engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))\n"
              "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))}))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
