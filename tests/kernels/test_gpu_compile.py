"""The Triton kernels compile for a Hopper GPU (sm_90, down to a cubin) on a machine without one.

The interpreter runs the kernels' arithmetic on the CPU but skips the GPU compiler, where
type and layout rules are stricter. This test captures the exact launches the launchers make
for a few configurations and compiles each for sm_90 with Triton's bundled ptxas, in a child
process without TRITON_INTERPRET.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import triton  # noqa: E402,F401  a dev dependency (`make test` installs it): missing is a failure, not a skip

REPO = Path(__file__).resolve().parents[2]

COMPILE_LAUNCHES = r"""
import types
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from kernels import decode_attention, kv_write, prefill_attention, triton_checks

launches = []

class Capture:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

for module, name in [(decode_attention, "_decode_partition_kernel"), (decode_attention, "_decode_merge_kernel"),
                     (prefill_attention, "_prefill_kernel"), (kv_write, "_write_kv_kernel")]:
    setattr(module, name, Capture(getattr(module, name)))

def problem(dtype, num_seqs, hq, hkv, d, block_size, width):
    q = torch.randn(num_seqs, hq, d).to(dtype)
    cache = torch.randn(16, block_size, hkv, d).to(dtype)
    tables = torch.zeros(num_seqs, width, dtype=torch.int32)
    return q, cache, tables, torch.ones(num_seqs, dtype=torch.int32)

for dtype, hq, hkv, d, width in [(torch.float32, 8, 4, 8, 2), (torch.bfloat16, 32, 8, 128, 64), (torch.float16, 8, 1, 80, 64)]:
    q, cache, tables, lens = problem(dtype, 2, hq, hkv, d, 16, width)
    decode_attention.paged_decode_attention(q, cache, cache, tables, lens, 0.1, sliding_window=7 if d == 80 else None)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    prefill_attention.paged_prefill_attention(q, cache, cache, tables, starts, lens, 0.1)
kv_write.write_kv(q[:, :hkv], q[:, :hkv], cache, cache, torch.arange(2))

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}
def signature_type(value):
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    return "fp32" if isinstance(value, float) else "i32"

target = GPUTarget("cuda", 90, 32)
for fn, args, kwargs in launches:
    kwargs = dict(kwargs)
    options = {"num_warps": kwargs.pop("num_warps")}
    if "DOT_DTYPE" in kwargs:  # what a CUDA tensor of this dtype gets
        cuda_q = types.SimpleNamespace(dtype=args[3].dtype, is_cuda=True)
        kwargs["DOT_DTYPE"], kwargs["DOT_PRECISION"] = triton_checks.dot_operands(cuda_q)
    names = fn.arg_names
    signature = {n: signature_type(v) for n, v in zip(names, args)}
    signature.update({n: "constexpr" for n in kwargs})
    compiled = triton.compile(ASTSource(fn, signature, kwargs), target=target, options=options)
    assert compiled.asm["cubin"], fn.__name__
    print("compiled", fn.__name__, {k: v for k, v in kwargs.items() if k in ("HEAD_DIM", "DOT_DTYPE", "SINGLE_PARTITION")},
          "shared", compiled.metadata.shared)
print("launches", len(launches))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the cuda tests compile the kernels for real")
def test_kernels_compile_for_sm90():
    import triton.backends.nvidia as nvidia  # Triton's wheel ships the NVIDIA backend and its ptxas

    ptxas = os.environ.get("TRITON_PTXAS_PATH") or Path(nvidia.__file__).parent / "bin" / "ptxas"
    assert Path(ptxas).exists(), f"no ptxas at {ptxas}: this Triton install cannot compile for a GPU"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_LAUNCHES], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "launches 9" in result.stdout, result.stdout  # decode: 1 + 2 + 2, prefill: 3, write_kv: 1
