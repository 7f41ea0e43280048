"""Linear layers on the CPU through oneDNN, with each weight packed once into its blocked layout.

torch's F.linear on the CPU repacks nothing and runs MKL's sgemm; oneDNN with a weight packed
ahead of time runs this repo's float32 shapes 1.1-2.1x faster on a 2-core AMD EPYC
(bench/bench_linear.py, bench/results/linear_onednn.json). Packing is the last step of
loading: the dense weight is dropped, so a model is packed once its weights are final.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def can_pack(weight: torch.Tensor) -> bool:
    """A CPU float32 or bfloat16 weight, on a build with oneDNN."""
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and onednn_available()


def pack(weight: torch.Tensor) -> torch.Tensor:  # opaque oneDNN tensor of weight [out_features, in_features]
    """The weight in oneDNN's blocked layout, for `linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(
    x: torch.Tensor,  # [num_tokens, in_features]
    weight: torch.Tensor,  # [out_features, in_features] (empty once packed)
    bias: torch.Tensor | None,  # [out_features]
    packed: torch.Tensor | None,  # pack(weight), or None
) -> torch.Tensor:  # [num_tokens, out_features]
    """x @ weight.T + bias, through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
