"""Quantized weights and inputs whose every value bfloat16 holds exactly, and the bound a matmul of them meets.

Power-of-two scales and zeros a whole number of steps make each weight a small integer times a power of
two; inputs are rounded to bfloat16 first. Every product is then exact on every path (bfloat16 dot
products, torch's int4 / int8 kernels, the unpack to bfloat16), and what remains is float32 accumulation
(K * 2^-24 of |x| @ |W|.T, taken twice) and the output's rounding to bfloat16 (8 significant bits: 2^-8 |ref|).
"""

import torch

from runtime.model import quantized
from runtime.model.quantized import Int4Weight


def exact_weight(cls, out_features: int, in_features: int, seed: int) -> tuple:
    """(weight, its values float64 [out, in], each value's step to the next level [out, in]): levels whose every
    value bfloat16 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    if cls is Int4Weight:
        width = -(-in_features // quantized.GROUP_SIZE) * quantized.GROUP_SIZE
        q = torch.randint(0, 16, (out_features, width), generator=g, dtype=torch.uint8)
        scale = 2.0 ** -torch.randint(6, 8, (out_features, width // quantized.GROUP_SIZE), generator=g).double()
        zero = torch.randint(-4, 5, scale.shape, generator=g).double() * scale  # value = (q - 8 + k) * scale
        steps = scale.repeat_interleave(quantized.GROUP_SIZE, 1)
        values = (q.double() - 8) * steps + zero.repeat_interleave(quantized.GROUP_SIZE, 1)
        return cls(q, scale.float(), zero.float(), in_features), values[:, :in_features], steps[:, :in_features]
    q = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = 2.0 ** -torch.randint(9, 11, (out_features,), generator=g).double()
    return cls(q, scale.float()), q.double() * scale[:, None], scale[:, None].expand(out_features, in_features)


def exact_input(rows: int, in_features: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, in_features, generator=g).bfloat16().to(dtype)  # [rows, in], bfloat16's values


def within_bound(out: torch.Tensor, x: torch.Tensor, values: torch.Tensor) -> tuple[bool, float]:
    """(whether out [rows, out] is x @ values.T up to float32 sums and bfloat16 output rounding, worst error / bound)."""
    ref = x.double() @ values.T  # [rows, out]
    if out.shape != ref.shape:
        raise ValueError(f"output {tuple(out.shape)}, expected {tuple(ref.shape)}")
    bound = 2**-8 * 1.01 * ref.abs() + values.shape[1] * 2**-23 * (x.double().abs() @ values.abs().T) + 1e-30
    worst = float(((out.double() - ref).abs() / bound).max())
    return worst <= 1.0, worst
