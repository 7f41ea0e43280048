"""Which backend a kernel call runs: resolve_backend, PAGEDSERVE_KERNELS, and clear errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import attention_backends, reference
from tests.kernels.helpers import paged_problem

REPO = Path(__file__).resolve().parents[2]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter at the repo root, without TRITON_INTERPRET unless given."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDSERVE_KERNELS")}
    child_env.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env, capture_output=True, text=True, timeout=120)


def test_auto_is_torch_on_cpu_and_triton_on_cuda(monkeypatch):
    import triton  # noqa: F401  a dev dependency: missing is a failure
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    assert kernels.resolve_backend("auto", CPU) == "torch"
    assert kernels.resolve_backend("auto", CUDA) == "triton"
    assert kernels.resolve_backend("torch", CUDA) == "torch"


def test_environment_overrides_auto_but_not_an_explicit_backend(monkeypatch):
    import triton  # noqa: F401  a dev dependency: missing is a failure
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "torch")
    assert kernels.resolve_backend("auto", CUDA) == "torch"
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    assert kernels.resolve_backend("torch", CPU) == "torch"
    if attention_backends.triton_kernels().interpreted:
        assert kernels.resolve_backend("auto", CPU) == "triton"
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "cuda")
    with pytest.raises(kernels.KernelBackendError, match="PAGEDSERVE_KERNELS='cuda'"):
        kernels.resolve_backend("auto", CPU)


def test_auto_on_cpu_runs_the_reference(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    k_cache, v_cache, tables, _, _ = paged_problem([5, 20], 2, 16, 8, torch.float32, seed=5)
    q = torch.randn(2, 4, 16)
    lens = torch.tensor([5, 20], dtype=torch.int32)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), rtol=0, atol=0)


DECODE_ON_CPU = """
import torch, kernels
q, cache = torch.randn(1, 2, 16), torch.randn(2, 16, 2, 16)
args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
print("auto:", kernels.resolve_backend("auto", torch.device("cpu")), kernels.paged_decode_attention(*args).shape)
try:
    kernels.paged_decode_attention(*args, backend="triton")
except kernels.KernelBackendError as exc:
    print("error:", exc)
"""


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    import triton  # noqa: F401  a dev dependency: missing is a failure
    result = run_python(DECODE_ON_CPU)
    assert result.returncode == 0, result.stderr
    assert "auto: torch torch.Size([1, 2, 16])" in result.stdout
    assert "error: backend 'triton' on a cpu tensor needs Triton's interpreter: set TRITON_INTERPRET=1" in result.stdout


def test_kernels_import_and_run_the_reference_without_triton():
    result = run_python("import sys; sys.modules['triton'] = None\n" + DECODE_ON_CPU)  # `import triton` fails
    assert result.returncode == 0, result.stderr
    assert "auto: torch torch.Size([1, 2, 16])" in result.stdout
    assert "error: the Triton kernels need the triton package" in result.stdout
