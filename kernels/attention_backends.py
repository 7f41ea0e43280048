"""Attention backends as objects, registered by name: the three calls a layer makes, and what each backend reads.

    name      write_kv            decode                                  prefill
    "torch"   C++ row copy (CPU)   cascade plan (C++ private parts), or    C++ cached part + causal chunk (CPU),
              or torch indexing    the reference over block tables         else the reference
    "triton"  Triton kernel        Triton split-K kernel (tables)          Triton kernel

A new backend (a CUDA-graph step, FlashInfer) is one class with these three methods and its
flags, added to ATTENTION_BACKENDS; the runner asks its flags, never its name. Triton is
imported on the first Triton call, so the registry works on installs without it.
"""

from __future__ import annotations

import functools
import types
from typing import Protocol

import torch

from kernels import cascade, cpu_attention, cpu_prefill, reference
from kernels.cascade import DecodePlan


class KernelBackendError(ValueError):
    """An unknown or unavailable kernel backend was requested."""


class AttentionBackend(Protocol):
    """The kernels one step's attention runs on (runtime/attention.py calls these three)."""

    name: str
    reads_decode_plans: bool  # decode reads a cascade plan (kernels/cascade.py): the runner makes one per window
    runs_native_decode: bool  # the C++ decode step (runtime/model/native_decode.py) may run a decode step's layers

    def check_device(self, device: torch.device) -> None:
        """Raise KernelBackendError if this backend cannot run on `device`."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor | None,
               context_lens: torch.Tensor, scale: float, sliding_window: int | None, plan: DecodePlan | None,
               softcap: float | None) -> torch.Tensor: ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None,
                softcap: float | None) -> torch.Tensor: ...


class TorchAttention:
    """Torch ops on any device, with the C++ CPU kernels where they apply; kernels/reference.py is the oracle."""

    name = "torch"
    reads_decode_plans = True
    runs_native_decode = True

    def check_device(self, device: torch.device) -> None:
        pass

    def write_kv(self, key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                 value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
                 k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                 v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                 slot_mapping: torch.Tensor) -> None:  # int64 [num_tokens]
        if (key.device.type == "cpu" and key.dtype == k_cache.dtype and value.dtype == k_cache.dtype
                and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
                and cpu_attention.available()):
            cpu_attention.write_kv(key, value, k_cache, v_cache, slot_mapping)  # one C++ call instead of two copies
        else:
            reference.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, plan, softcap):
        if softcap is not None:
            if block_tables is None:
                raise ValueError("soft-capped decode attention runs the reference: it needs block_tables, not a plan")
            return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                    sliding_window, softcap)
        if plan is not None:
            return cascade.cascade_decode_attention(q, k_cache, v_cache, plan, scale)
        if block_tables is None:
            raise ValueError("paged_decode_attention needs block_tables or a plan")
        return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)

    def prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window,
                softcap):
        if softcap is None and q.device.type == "cpu":
            return cpu_prefill.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                       context_lens, scale, sliding_window)
        return reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                                                 scale, sliding_window, softcap)


@functools.cache
def triton_kernels() -> types.SimpleNamespace:
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


class TritonAttention:
    """The Triton kernels (decode_attention.py, prefill_attention.py, kv_write.py): CUDA tensors, or CPU
    tensors under Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported; slow, for tests)."""

    name = "triton"
    reads_decode_plans = False
    runs_native_decode = False

    def check_device(self, device: torch.device) -> None:
        interpreted = triton_kernels().interpreted  # KernelBackendError without the triton package
        if device.type != "cuda" and not interpreted:
            raise KernelBackendError(
                f"backend 'triton' on a {device.type} tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before triton is first imported (slow; meant for tests), or use backend='torch'"
            )

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        triton_kernels().write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, plan, softcap):
        if block_tables is None:
            raise ValueError("the Triton decode kernel needs block_tables (it does not read a plan)")
        return triton_kernels().paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                       sliding_window, softcap=softcap)

    def prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window,
                softcap):
        return triton_kernels().paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                                        context_lens, scale, sliding_window, softcap=softcap)


# backend name -> its kernels ("auto" is not one: kernels.resolve_backend picks one of these)
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {"torch": TorchAttention(), "triton": TritonAttention()}


def attention_backend(name: str) -> AttentionBackend:
    """The registered backend called `name`; KernelBackendError if there is none."""
    backend = ATTENTION_BACKENDS.get(name)
    if backend is None:
        raise KernelBackendError(f"unknown kernel backend {name!r}; expected one of {('auto', *ATTENTION_BACKENDS)}")
    return backend
