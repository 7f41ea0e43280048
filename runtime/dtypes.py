"""The engine's dtype by name, "auto" included: bf16 where the hardware runs it fast.

"auto" on CUDA is bfloat16 (float16 where the GPU lacks bf16); on a CPU it is bfloat16 when
the CPU has AMX or AVX512-BF16 (bf16 matmuls about 2x float32 through oneDNN on an AVX512-BF16
EPYC, 3-6x with AMX), else float32 (bf16 is ~100x slower on plain AVX2).
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_flags

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FAST_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def resolve_dtype(name: str, device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """The torch dtype for `name` ("float32", "float16", "bfloat16" or "auto") on `device`.

    `flags` stands in for the CPU's flags (tests). Raises ValueError for an unknown name.
    """
    if name in DTYPES:
        return DTYPES[name]
    if name != "auto":
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}")
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and (cpu_flags() if flags is None else flags) & FAST_BF16_CPU_FLAGS:
        return torch.bfloat16
    return torch.float32
