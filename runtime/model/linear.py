"""Linear layers on the CPU through oneDNN, with each weight packed once into its blocked layout.

torch's F.linear on the CPU repacks nothing and runs MKL's sgemm; oneDNN with a weight packed
ahead of time runs this repo's float32 shapes 1.1-2.1x faster on a 2-core AMD EPYC
(bench/bench_linear.py, bench/results/linear_onednn.json), most at decode sizes.

oneDNN builds a primitive for each new input shape (~0.4 ms per linear here) and caches it
(1,024 by default, least recently used out), so a server whose batch size changes every step
would pay that again and again. Inputs of up to PACKED_MAX_TOKENS rows (decode batches) each
have their primitive, which `warm_up` builds once at start. Longer inputs (prefill chunks) are
padded with zero rows to a multiple of PADDED_ROW_STEP, so only a few more shapes are ever
built, each once, on first use: at 129-4,096 rows that is 62 sizes x 4 layer shapes, and the
cache never evicts the decode sizes. Inputs past PADDED_MAX_TOKENS take F.linear on the dense
weight, which is kept.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from runtime.model.quantized import QuantizedWeight

PACKED_MAX_TOKENS = 128  # every size up to here has its own primitive, built at start
PADDED_ROW_STEP = 64  # longer inputs are padded to a multiple of this
PADDED_MAX_TOKENS = 4096  # 4 layer shapes x (128 + 62) sizes: 760 primitives, within oneDNN's cache of 1,024


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it needs AVX512BW/VL/DQ or AVX-NE-CONVERT; AVX2 has neither)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack(weight: torch.Tensor) -> bool:
    """A CPU float32 weight, or a bfloat16 one where the CPU can, on a build with oneDNN."""
    if weight.device.type != "cpu" or not onednn_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16_available())


def pack(weight: torch.Tensor) -> torch.Tensor:  # opaque oneDNN tensor of weight [out_features, in_features]
    """The weight in oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features]; unused (empty) for a quantized weight
    bias: torch.Tensor | None,  # [out_features]
    packed,  # pack(weight), a QuantizedWeight (runtime/model/quantized.py), or None
) -> torch.Tensor:  # [num_tokens, out_features]
    """x @ weight.T + bias, through the packed or quantized weight when there is one and x is not too long."""
    if isinstance(packed, QuantizedWeight):
        return packed.linear(x, bias)
    rows = x.shape[0]
    if packed is None or rows > PADDED_MAX_TOKENS:
        return F.linear(x, weight, bias)
    if rows <= PACKED_MAX_TOKENS:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    padded = F.pad(x, (0, 0, 0, -rows % PADDED_ROW_STEP))  # [rows rounded up, in_features]; zero rows
    return torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")[:rows]


def warm_up(weights: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]) -> int:
    """Build the packed path's primitives for every size it serves; returns how many shapes were built.

    `weights`: (weight, bias, packed) per layer; one of each distinct shape is enough, as
    oneDNN caches primitives by shape, not by data.
    """
    seen = set()
    for weight, bias, packed in weights:
        key = (tuple(weight.shape), weight.dtype, bias is not None)
        if key in seen:
            continue
        seen.add(key)
        for rows in range(1, PACKED_MAX_TOKENS + 1):
            linear(torch.zeros(rows, weight.shape[1], dtype=weight.dtype), weight, bias, packed)
    return len(seen)
