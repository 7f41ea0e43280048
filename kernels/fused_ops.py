"""The decoder layer's elementwise ops, fused in C++ on the CPU (kernels/csrc/fused_ops.cpp).

Each op has its torch form here too: the oracle for the C++ one, and the path wherever that
cannot build or the tensors are not on the CPU. Both round as transformers' torch code does
(kernels/csrc/fused_ops.cpp says where), so greedy tokens stay those of the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_extension


def _extension():
    return cpu_extension.load("fused_ops.cpp", ("-ffp-contract=off",))


def native_for(x: torch.Tensor) -> bool:
    """Whether the C++ ops serve tensors like `x` (CPU, float32 or bfloat16, and built)."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and _extension() is not None


def add_rms_norm_torch(
    x: torch.Tensor | None,  # [rows, size]
    residual: torch.Tensor,  # [rows, size]; += x in place
    weight: torch.Tensor,  # [size]
    eps: float,
) -> torch.Tensor:  # [rows, size]
    """residual += x (in place, when x is given); returns weight * rms_norm(residual) (torch ops)."""
    if x is not None:
        residual.add_(x)
    x32 = residual.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(residual.dtype)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 native: bool) -> torch.Tensor:  # [rows, size]
    """residual += x (in place, when x is given); returns weight * rms_norm(residual)."""
    if not native:
        return add_rms_norm_torch(x, residual, weight, eps)
    empty = residual.new_empty(0)
    return _extension().add_rms_norm(empty if x is None else x.contiguous(), residual, weight, eps)


def rope_qkv_torch(
    qkv: torch.Tensor,  # [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # int64 [tokens]
    cos: torch.Tensor,  # float32 [max_positions, rotary_dim]
    sin: torch.Tensor,  # float32 [max_positions, rotary_dim]
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,  # default rotary_dim; larger: partial rotary, the rest of each head kept
) -> tuple[torch.Tensor, torch.Tensor]:  # q [tokens, num_q_heads, head_dim], k [tokens, num_kv_heads, head_dim]
    """Rotate-half RoPE of the q and k heads of fused qkv rows (torch ops), on each head's first rotary_dim dims."""
    rotary_dim = cos.shape[1]
    head_dim = head_dim or rotary_dim
    tokens = qkv.shape[0]
    q, k, _ = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    c = cos[positions][:, None, :].to(qkv.dtype)  # [tokens, 1, rotary_dim]
    s = sin[positions][:, None, :].to(qkv.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x, kept = x[..., :rotary_dim], x[..., rotary_dim:]
        half = rotary_dim // 2
        rotated = x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s
        return torch.cat((rotated, kept), dim=-1) if kept.shape[-1] else rotated

    return rotate(q.view(tokens, num_q_heads, head_dim)), rotate(k.view(tokens, num_kv_heads, head_dim))


def rope_qkv(qkv, positions, cos, sin, num_q_heads: int, num_kv_heads: int, native: bool, head_dim: int | None = None):
    """Rotate-half RoPE of the q and k heads of fused qkv rows: (q, k), each contiguous.

    `head_dim` past the tables' width: partial rotary (torch ops; the C++ op rotates whole heads).
    """
    if not native or (head_dim is not None and head_dim != cos.shape[1]):
        return rope_qkv_torch(qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim)
    q, k = _extension().rope_qkv(qkv.contiguous(), positions.contiguous(), cos, sin, num_q_heads, num_kv_heads)
    return q, k


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:  # gate_up [rows, 2 * size] -> [rows, size]
    """silu(gate) * up of fused gate_up rows (torch ops)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor, native: bool) -> torch.Tensor:  # [rows, size]
    """silu(gate) * up of fused gate_up rows [rows, 2 * size]."""
    if not native:
        return silu_and_mul_torch(gate_up)
    return _extension().silu_and_mul(gate_up.contiguous())


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # gate_up [rows, 2 * size] -> [rows, size]
    """gelu(gate, tanh approximation) * up of fused gate_up rows: Gemma's GeGLU (torch ops)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
