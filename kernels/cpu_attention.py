"""The CPU's paged decode attention in C++ (kernels/csrc/paged_decode.cpp), built on first use.

One query token per sequence attends to positions [starts[i], ends[i]) of its page table,
read from the pages in place: no gather of K/V into a padded copy, no mask tensor. It
returns the log-sum-exp beside the output so that kernels/cascade.py can merge it with a
shared prefix's part.

The extension is compiled once per machine with the compiler torch was built against
(torch.utils.cpp_extension.load, -O3 -march=native, OpenMP through at::parallel_for) and
cached under torch's extension folder; its name holds a hash of the source, the torch
version and the CPU's flags, so a different machine or source builds its own. Where it
cannot build (no compiler, no ninja) or PAGEDSERVE_CPU_ATTENTION=torch, `available()` is
False, one warning is logged, and the callers take the torch path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib

import structlog
import torch

_SOURCE = pathlib.Path(__file__).parent / "csrc" / "paged_decode.cpp"
_log = structlog.get_logger(__name__)


def _cpu_flags() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _extension_name() -> str:
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode()):
        digest.update(part)
    return f"pagedserve_paged_decode_{digest.hexdigest()[:16]}"


@functools.cache
def _extension():
    """The compiled module, or None where it cannot be had (logged once)."""
    if os.environ.get("PAGEDSERVE_CPU_ATTENTION", "native") == "torch":
        return None
    try:
        from torch.utils import cpp_extension

        _log.info("cpu_attention.loading", source=str(_SOURCE))
        module = cpp_extension.load(
            name=_extension_name(),
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a build error: the torch path serves
        _log.warning("cpu_attention.unavailable", error=str(exc)[:500], fallback="torch")
        return None
    _log.info("cpu_attention.ready", name=module.__name__)
    return module


def available() -> bool:
    """Whether the C++ decode kernel is built (building it on the first call)."""
    return _extension() is not None


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim], float32 or bfloat16
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], q's dtype
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], q's dtype
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    starts: torch.Tensor,  # int32 [num_seqs]; first position each row attends to
    ends: torch.Tensor,  # int32 [num_seqs]; one past the last
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_seqs, num_q_heads, head_dim] in q's dtype, lse float32 [num_seqs, num_q_heads]
    """Attention of each row's query over positions [starts, ends) of its pages, with its log-sum-exp.

    A row with an empty range gets zeros and lse -inf. Raises ValueError on inconsistent
    shapes or dtypes, or a range or page outside the table or cache; RuntimeError where the
    kernel is not available.
    """
    module = _extension()
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not available (see the cpu_attention.unavailable log)")
    out, lse = module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables.contiguous(), starts.contiguous(),
                                   ends.contiguous(), float(scale))
    return out, lse
