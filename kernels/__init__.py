"""Attention and cache kernels behind one call per operation, whatever the backend.

`backend="auto"` picks the torch reference for CPU tensors. The environment variable
PAGEDSERVE_KERNELS=torch|triton overrides "auto". Triton kernels for CUDA are not part of
this package yet; asking for them raises KernelBackendError.
"""

from __future__ import annotations

import os

import torch

from kernels import reference

BACKENDS = ("auto", "torch", "triton")


class KernelBackendError(ValueError):
    """An unknown or unavailable kernel backend was requested."""


def resolve_backend(backend: str, device: torch.device) -> str:
    """Return the concrete backend ("torch" or "triton") for `backend` on `device`."""
    if backend == "torch":
        return backend
    if backend not in BACKENDS:
        raise KernelBackendError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = os.environ.get("PAGEDSERVE_KERNELS", "auto")
        if backend not in BACKENDS:
            raise KernelBackendError(f"PAGEDSERVE_KERNELS={backend!r}; expected torch or triton")
    if backend == "auto":
        backend = "torch"
    if backend == "triton":
        raise KernelBackendError("the Triton kernels are not available in this build; use backend='torch'")
    return backend


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    backend: str = "auto",
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_q_heads, head_dim]
    """Attention of one new query token per sequence over that sequence's pages."""
    resolve_backend(backend, q.device)
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
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of ragged query chunks over their cached pages plus themselves."""
    resolve_backend(backend, q.device)
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window
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
    resolve_backend(backend, key.device)
    reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


__all__ = [
    "KernelBackendError",
    "paged_decode_attention",
    "paged_prefill_attention",
    "resolve_backend",
    "write_kv",
]
