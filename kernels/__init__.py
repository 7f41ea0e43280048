"""Attention and cache kernels behind one call per operation, whatever the backend.

Backends:
    "torch"   torch ops on any device: the CPU backend. Decode goes through kernels/cascade.py
              when given a plan (shared prefixes read once per group, private parts in C++:
              kernels/cpu_attention.py), prefill on the CPU through kernels/cpu_prefill.py
              (cached part plus a causal chunk), else through the reference in
              kernels/reference.py, which is also the oracle for every backend
    "triton"  the Triton kernels in decode_attention.py, prefill_attention.py, kv_write.py:
              CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 set
              before triton is first imported; slow, for tests)
    "auto"    CUDA tensors -> "triton", anything else -> "torch"; the environment variable
              PAGEDSERVE_KERNELS=torch|triton overrides it

resolve_backend() turns a backend into "torch" or "triton" once (the engine does it at start);
the calls take the concrete name on a fast path. Triton is imported only when a Triton
kernel is first needed, so `import kernels` works on installs without it.
"""

from __future__ import annotations

import functools
import os
import types
import warnings

import torch

from kernels import cascade, cpu_attention, cpu_prefill, fused_ops, reference
from kernels.cascade import DecodePlan, plan_decode

BACKENDS = ("auto", "torch", "triton")


class KernelBackendError(ValueError):
    """An unknown or unavailable kernel backend was requested."""


@functools.cache
def _triton_kernels() -> types.SimpleNamespace:
    """The Triton launchers, imported on first use."""
    try:
        from kernels import decode_attention, kv_write, prefill_attention
    except ImportError as exc:
        raise KernelBackendError(
            f"the Triton kernels need the triton package ({exc}); install pagedserve[gpu] or use backend='torch'"
        ) from exc
    from triton.runtime.jit import JITFunction

    return types.SimpleNamespace(
        paged_decode_attention=decode_attention.paged_decode_attention,
        paged_prefill_attention=prefill_attention.paged_prefill_attention,
        write_kv=kv_write.write_kv,
        # @triton.jit made interpreted kernels if TRITON_INTERPRET was set when they were defined
        interpreted=not isinstance(decode_attention._decode_partition_kernel, JITFunction),
    )


def _triton_for(device: torch.device) -> types.SimpleNamespace:
    """The Triton launchers if they can run on `device`; else KernelBackendError."""
    kernels = _triton_kernels()
    if device.type != "cuda" and not kernels.interpreted:
        raise KernelBackendError(
            f"backend 'triton' on a {device.type} tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (slow; meant for tests), or use backend='torch'"
        )
    return kernels


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return the concrete backend ("torch" or "triton") for `backend` on `device`.

    Raises KernelBackendError for an unknown name, or for "triton" where it cannot run.
    """
    if backend == "torch":
        return backend
    if backend not in BACKENDS:
        raise KernelBackendError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = os.environ.get("PAGEDSERVE_KERNELS", "auto")
        if backend not in BACKENDS:
            raise KernelBackendError(f"PAGEDSERVE_KERNELS={backend!r}; expected torch or triton")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        try:
            _triton_for(device)
        except KernelBackendError as exc:
            warnings.warn(f"falling back to the torch reference kernels on CUDA: {exc}", stacklevel=2)
            return "torch"
        return "triton"
    _triton_for(device)
    return backend


def _backend_for(backend: str, tensor: torch.Tensor) -> str:
    """The concrete backend for one call; "torch" and "triton" on CUDA cost two comparisons."""
    if backend == "torch" or (backend == "triton" and tensor.is_cuda):
        return backend
    return resolve_backend(backend, tensor.device)


def prepare_cpu_kernels() -> dict[str, bool]:
    """Build or load the C++ CPU kernels now (a minute the first time on a machine), not on a first request.

    Returns which are available; those that are not leave their callers on the torch path.
    """
    from kernels import grouped_matmul, quant_matmul, weight_unpack

    return {"paged_decode": cpu_attention.available(), "fused_ops": fused_ops.native_for(torch.zeros(1)),
            "weight_unpack": weight_unpack.available(), "quant_matmul": quant_matmul.available(),
            "grouped_matmul": grouped_matmul.available()}


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor | None,  # int32 [num_seqs, max_blocks_per_seq]; may be None with a plan
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    backend: str = "auto",
    sliding_window: int | None = None,
    plan: DecodePlan | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Attention of one new query token per sequence over that sequence's pages.

    `plan` (from plan_decode over the same tables, lengths and window) lets the torch backend
    read each shared prefix once per group (kernels/cascade.py); the result is the same, and
    Triton ignores it. `softcap` (Gemma 2's soft-capped scores) runs the reference on the torch
    backend (no plan: block_tables), and the Triton kernel on CUDA.
    """
    if _backend_for(backend, q) == "triton":
        if block_tables is None:
            raise ValueError("the Triton decode kernel needs block_tables (it does not read a plan)")
        return _triton_kernels().paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap=softcap
        )
    if softcap is not None:
        if block_tables is None:
            raise ValueError("soft-capped decode attention runs the reference, which needs block_tables, not a plan")
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                sliding_window, softcap)
    if plan is not None:
        return cascade.cascade_decode_attention(q, k_cache, v_cache, plan, scale)
    if block_tables is None:
        raise ValueError("paged_decode_attention needs block_tables or a plan")
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32 [num_seqs + 1]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    backend: str = "auto",
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of ragged query chunks over their cached pages plus themselves."""
    if _backend_for(backend, q) == "triton":
        return _triton_kernels().paged_prefill_attention(
            q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, softcap=softcap
        )
    if softcap is None and q.device.type == "cpu":
        return cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                                   scale, sliding_window)
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window, softcap
    )


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    backend: str = "auto",
) -> None:
    """Write new tokens' K/V rows into their slots."""
    if _backend_for(backend, key) == "triton":
        _triton_kernels().write_kv(key, value, k_cache, v_cache, slot_mapping)
    elif (key.device.type == "cpu" and key.dtype == k_cache.dtype and value.dtype == k_cache.dtype
          and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value)) and cpu_attention.available()):
        cpu_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)  # one C++ call instead of two copies
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


__all__ = [
    "BACKENDS",
    "DecodePlan",
    "KernelBackendError",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode",
    "prepare_cpu_kernels",
    "resolve_backend",
    "write_kv",
]
