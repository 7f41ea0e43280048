"""A decode step's decoder layers in one C++ call on the CPU (kernels/csrc/decode_step.cpp).

The step calls the other kernel modules' own functions (fused_ops.cpp, grouped_matmul.cpp,
paged_decode.cpp) through their exported entry points, so it computes what the Python path
computes, to the bit, without the Python, module calls and views between a layer's ~15
operations. runtime/model/native_decode.py decides which models and steps it serves and gives
it their weights.
"""

from __future__ import annotations

import torch

from kernels import cpu_attention, cpu_extension, fused_ops, grouped_matmul


def _extension():
    return cpu_extension.load("decode_step.cpp")


def available() -> bool:
    """Whether the step and every module it calls are built (building them now if not yet)."""
    return (_extension() is not None and fused_ops.native_for(torch.zeros(1)) and grouped_matmul.available()
            and cpu_attention.available())


def new_step(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
             first_norm: torch.Tensor):
    """An empty step (needs `available()`): add_layer(spec) per layer in order, then forward(...) per decode step.

    `first_norm`: layer 0's input norm weight, float32 [hidden]. See decode_step.cpp for the spec's keys.
    """
    config = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "eps": float(eps),
              "scale": float(scale)}
    return _extension().DecodeStep(fused_ops._extension().entry_points, grouped_matmul._extension().entry_points,
                                   cpu_attention._extension().entry_points, config, first_norm)
