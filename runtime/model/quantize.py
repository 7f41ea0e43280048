"""Which form each matmul weight takes (dense, grouped, int8, int4) and putting it in the model.

`engine.quantization` (and `--quantization`) picks it:

    auto   a GGUF file's weights are computed as the file has them, nothing re-quantized: each
           type whose groups a CPU kernel runs keeps them (runtime/model/grouped.py, float32
           scales and sums, the file's values exactly): Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS as
           grouped4; Q5_0, Q5_1, Q5_K, Q6_K as grouped6 (their int8 codes in 6 bits); Q8_0 as
           grouped8. The LM head too, in either
           engine dtype (its sums are float32). Other types (F16, BF16, F32, Q2_K, Q3_K, the
           IQ2/IQ3/IQ1 grids, ...) are dequantized to the engine's dtype. A checkpoint folder
           stays dense. gguf_loader logs, per tensor type, the form it runs in.
    none   every weight dense, in the engine's dtype.
    int8   every matmul weight int8, one scale per row.
    int4   every matmul weight int4, a (scale, zero) per 32 inputs (Q4_0/Q4_1 blocks as they
           are, scales rounded to bfloat16); the LM head int8 (logits are where 4 bits hurt
           most, and llama.cpp keeps its output matrix wider too).

int8 and int4 run torch's kernels (or ours on AVX512-BF16), in bfloat16, and round their outputs
to it. For the layers that is noise the next norm absorbs; for the logits of a float32 engine
it is not (two candidates 0.09 apart tie after rounding, and greedy answers change), so under
those modes a float32 engine keeps its LM head dense in float32; a bfloat16 engine's logits are
bfloat16 anyway.

The quantized kernels are CPU ones: on CUDA only `none` and `auto` (dense) load.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.model import ggml_blocks
from runtime.model.config import UnsupportedModelError
from runtime.model.quantized import COMPUTE_DTYPE, Int4Weight, Int8Weight, QuantizedWeight

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")


def check_quantization(mode: str, device: torch.device) -> None:
    """Raise UnsupportedModelError for an unknown mode, or a quantized one on a device without its kernels."""
    if mode not in QUANTIZATION_MODES:
        raise UnsupportedModelError(f"quantization {mode!r} is not one of {', '.join(QUANTIZATION_MODES)}")
    if mode in ("int8", "int4") and device.type != "cpu":
        raise UnsupportedModelError(f"quantization {mode!r} runs on the CPU only (torch's weight-only kernels); "
                                    f"on {device.type} use 'none' or 'auto' (GGUF weights are dequantized)")


def gguf_form(mode: str, qtype: int, device: torch.device, lm_head: bool, dtype: torch.dtype) -> str:
    """'dense', 'grouped4', 'grouped6', 'grouped8', 'int8' or 'int4' for a matmul weight of ggml type `qtype` under
    `mode`."""
    if device.type != "cpu" or mode == "none":
        return "dense"
    if mode == "auto":  # the file's own groups where a kernel runs them (float32 sums: the LM head too)
        if qtype in ggml_blocks.GROUPED_TYPES:
            return "grouped4" if qtype in ggml_blocks.FOUR_BIT_TYPES else "grouped8" if qtype == ggml_blocks.Q8_0 else "grouped6"
        return "dense"
    if lm_head and dtype != COMPUTE_DTYPE:
        return "dense"
    return "int8" if mode == "int8" or lm_head else "int4"


def folder_form(mode: str, lm_head: bool, dtype: torch.dtype) -> str:
    """The form of a checkpoint folder's float weight under `mode` (auto: dense)."""
    if mode in ("auto", "none") or (lm_head and dtype != COMPUTE_DTYPE):
        return "dense"
    return "int8" if mode == "int8" or lm_head else "int4"


def quantize_float(weight: torch.Tensor, form: str) -> QuantizedWeight:
    return Int4Weight.quantize(weight) if form == "int4" else Int8Weight.quantize(weight)


def placeholder(dtype: torch.dtype) -> nn.Parameter:
    """The empty parameter that stands where a weight kept in another form (quantized, encoded) was."""
    return nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def install_linear(module: nn.Module, name: str, form, dtype: torch.dtype) -> None:
    """Give slot `name` of `module` its weight: a dense tensor (a parameter) or a QuantizedWeight."""
    if isinstance(form, QuantizedWeight):
        setattr(module, f"{name}_weight", placeholder(dtype))
        setattr(module, f"{name}_packed", form)
    else:
        setattr(module, f"{name}_weight", nn.Parameter(form.to(dtype), requires_grad=False))
        setattr(module, f"{name}_packed", None)


def quantize_model(model, mode: str) -> int:
    """Quantize a loaded dense model's matmul weights in place (`mode` int8 or int4; auto/none do nothing).

    Each dense weight is dropped as soon as its quantized form exists. Returns how many were quantized.
    """
    if mode in ("auto", "none"):
        return 0
    count = 0
    dtype = model.norm.weight.dtype
    for module, name in model.linear_slots():
        weight = getattr(module, f"{name}_weight")
        install_linear(module, name, quantize_float(weight.data, folder_form(mode, False, dtype)), dtype)
        count += 1
    if folder_form(mode, True, dtype) == "dense":
        return count
    head = quantize_float(model.lm_head.data, folder_form(mode, True, dtype))
    if model.config.tie_word_embeddings:
        model.embed_rows = head  # int8: rows are looked up from the same table
        model.embed_tokens = placeholder(dtype)
    model.lm_head = model.embed_tokens if model.config.tie_word_embeddings else placeholder(dtype)
    model.lm_head_packed = head
    return count + 1
