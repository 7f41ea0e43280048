"""Attention and cache kernels behind one call per operation, whatever the backend.

Backends are objects registered by name (kernels/attention_backends.py, ATTENTION_BACKENDS):
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

resolve_backend() turns a backend into a registered name once (the engine does it at start,
and its runner holds the object: attention_backend(name)); the functions below take a name,
for callers without a runner. Triton is imported only when a Triton kernel is first needed,
so `import kernels` works on installs without it.
"""

from __future__ import annotations

import os
import warnings

import torch

from kernels import cpu_attention, fused_ops
from kernels.attention_backends import ATTENTION_BACKENDS, AttentionBackend, KernelBackendError, attention_backend
from kernels.cascade import DecodePlan, plan_decode

BACKENDS = ("auto", *ATTENTION_BACKENDS)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return the registered backend's name ("torch" or "triton") for `backend` on `device`.

    Raises KernelBackendError for an unknown name, or for a backend that cannot run on `device`.
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
            ATTENTION_BACKENDS["triton"].check_device(device)
        except KernelBackendError as exc:
            warnings.warn(f"falling back to the torch reference kernels on CUDA: {exc}", stacklevel=2)
            return "torch"
        return "triton"
    ATTENTION_BACKENDS[backend].check_device(device)
    return backend


def _backend_for(backend: str, tensor: torch.Tensor) -> AttentionBackend:
    """The backend for one call; "torch", and "triton" on CUDA, cost a comparison and a lookup."""
    if backend == "torch" or (backend == "triton" and tensor.is_cuda):
        return ATTENTION_BACKENDS[backend]
    return ATTENTION_BACKENDS[resolve_backend(backend, tensor.device)]


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
    return _backend_for(backend, q).decode(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                           plan, softcap)


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
    return _backend_for(backend, q).prefill(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                            sliding_window, softcap)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    backend: str = "auto",
) -> None:
    """Write new tokens' K/V rows into their slots."""
    _backend_for(backend, key).write_kv(key, value, k_cache, v_cache, slot_mapping)


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "BACKENDS",
    "DecodePlan",
    "KernelBackendError",
    "attention_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode",
    "prepare_cpu_kernels",
    "resolve_backend",
    "write_kv",
]
