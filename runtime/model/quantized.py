"""Weight-only quantized matrices for the CPU: 4-bit (group 32) and 8-bit (per row), through torch's kernels.

One decode token reads every weight once, so at batch sizes of a few rows a linear layer is
bound by memory traffic, and weights kept at 4 bits read 8x less than float32. torch's CPU
kernels do the matmul straight from the packed integers:

    Int4Weight  value = (q - 8) * scale + zero    q in 0..15, one (scale, zero) per 32 inputs of a row
                aten._weight_int4pack_mm_for_cpu  (Q4_0 and Q4_1 map onto it exactly:
                Q4_0: scale d, zero 0; Q4_1: scale d, zero m + 8 d)
    Int8Weight  value = q * scale                 q in -127..127, one scale per row
                aten._weight_int8pack_mm

Both kernels take bfloat16 activations (their float32 paths are 10-30x slower here, see
BENCHMARKS.md), so inputs are cast to bfloat16 and results back to the caller's dtype.
They compute in float32 FMAs and unpack the weight again for every few rows, which a batch
of many rows outgrows. On a CPU with AVX512-BF16 our kernels run instead (C++,
kernels/quant_matmul.py), in bfloat16 dot products: an int4 matmul of fewer than
INT4_MANY_ROWS rows reads its nibbles by table and applies each group's scale to the group's
sums (the weight unrounded, as torch's kernel multiplies by); from INT4_MANY_ROWS rows on, each
64-output block's nibbles are unpacked in cache once per call and every row multiplied there in
the same arithmetic (the two agree bit for bit, so a prefix-cache hit computes what a cold prompt does);
the int8 LM head is converted 16 rows at a time. Elsewhere, and for an int8 LM head past
INT8_BF16_DOT_MAX_ROWS rows, the layer's weight is unpacked from DENSE_MIN_ROWS rows on into a
scratch bfloat16 matrix (C++, kernels/weight_unpack.py), multiplied by oneDNN (AMX or AVX512-BF16
where the CPU has them), then dropped.
The kernels' shape rules (int4: rows a multiple of 16, inputs of 32; int8: inputs a multiple
of 16) are met by padding with zero rows and columns at load; an input is padded to match
only when its width was.

Scales are stored in bfloat16, so a file's float16 scale may round: Int4Weight.from_q4 is
exact to bfloat16's precision, not bit for bit (tests/runtime/test_quantized.py says how close).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import quant_matmul, weight_unpack

GROUP_SIZE = 32  # inputs per (scale, zero) pair of a 4-bit row: Q4_0's and Q4_1's block
COMPUTE_DTYPE = torch.bfloat16  # what the kernels take
INT4_ROW_MULTIPLE = 64  # the kernel wants 16; 64 keeps torch's layout in whole blocks (kernels/weight_unpack.py)
# from this many rows on, unpacking the layer to bfloat16 and one oneDNN matmul beat the
# integer kernels (bench/bench_quantized_linear.py, BENCHMARKS.md section 17): the integer kernels compute in float32
# FMAs, oneDNN in AMX/AVX512-BF16; the unpack (~50 ms for all 106M weights of SmolLM2) pays from 64 rows
DENSE_MIN_ROWS = 64
# on a CPU with AVX512-BF16 kernels/quant_matmul.py takes every int4 matmul (bench/bench_quantized_linear.py,
# BENCHMARKS.md section 17; AMD EPYC, ms per 30-layer pass of SmolLM2). Its two int4 kernels give the same
# result bit for bit, so the switch only moves time: the few-rows kernel beats torch's at every size
# (1: 2.5 vs 3.9, 16: 13.0 vs 23.5) and the many-rows one up to ~128 rows (64: 50.0 vs 51.0, 128: 94.8 vs
# 100.0); past that the many-rows kernel (unpacking each block once) wins (512: 371 vs 424). The int8 LM
# head: ours from 1 row (2.2 vs 2.7 ms; 16: 5.2 vs 15.0) to INT8_BF16_DOT_MAX_ROWS, past which the unpack +
# oneDNN wins (512 rows: 112 vs 144 ms)
INT4_MANY_ROWS = 128
INT8_BF16_DOT_MAX_ROWS = 128
INT4_COL_MULTIPLE = GROUP_SIZE
INT8_COL_MULTIPLE = 16


class QuantizationError(ValueError):
    """A weight that cannot be quantized as asked (named by the caller)."""


def _pad_to(tensor: torch.Tensor, dim: int, multiple: int, value=0) -> torch.Tensor:
    extra = -tensor.shape[dim] % multiple
    if not extra:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim) + [0, extra]
    return F.pad(tensor, pad, value=value)


class QuantizedWeight:
    """A [out_features, in_features] weight kept in integers; `linear` is x @ W.T + bias."""

    out_features: int
    in_features: int
    _padded_in: int

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:  # [rows, padded_in] bfloat16
        if x.dtype != COMPUTE_DTYPE:
            x = x.to(COMPUTE_DTYPE)
        if self._padded_in != self.in_features:
            x = F.pad(x, (0, self._padded_in - self.in_features))
        return x if x.is_contiguous() else x.contiguous()

    def _finish(self, out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        if out.dtype != dtype:
            out = out.to(dtype)
        return out if bias is None else out + bias

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:  # float32 [out_features, in_features]
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [len(ids), in_features]
        """The weight's rows `ids`, dequantized (an embedding lookup from the same table)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


class Int4Weight(QuantizedWeight):
    """4-bit weights with a float (scale, zero) per 32 inputs, in torch's packed CPU layout."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int | None = None) -> None:
        """q uint8 [out, in] in 0..15; scale, zero [out, in // 32]; value = (q - 8) * scale + zero.

        `in_features`: the true input width when q's last columns are padding (default: all of q).
        """
        out_features, width = q.shape
        if tuple(scale.shape) != (out_features, width // GROUP_SIZE) or width % GROUP_SIZE:
            raise QuantizationError(f"int4 weight [{out_features}, {width}] needs scales "
                                    f"[{out_features}, {width // GROUP_SIZE}], got {tuple(scale.shape)}")
        self.out_features, self.in_features = out_features, in_features or width
        q = _pad_to(_pad_to(q.to(torch.int32), 0, INT4_ROW_MULTIPLE, 8), 1, INT4_COL_MULTIPLE, 8)
        scale = _pad_to(_pad_to(scale, 0, INT4_ROW_MULTIPLE), 1, INT4_COL_MULTIPLE // GROUP_SIZE)
        zero = _pad_to(_pad_to(zero, 0, INT4_ROW_MULTIPLE), 1, INT4_COL_MULTIPLE // GROUP_SIZE)
        self._padded_in = q.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)  # uint8, torch's layout
        # [in // 32, out, 2]: the kernel's (scale, zero) table
        self.scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(COMPUTE_DTYPE)

    @classmethod
    def from_q4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4Weight:
        """From ggml's 4-bit blocks (value = q * d + m, runtime/model/ggml_blocks.unpack_q4)."""
        return cls(q, d, m + 8 * d)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Round a float weight [out, in] to 4 bits: per 32 inputs, 16 levels from its min to its max.

        `in` not a multiple of 32 is padded with zero columns first (they cost nothing in the result).
        """
        in_features = weight.shape[1]
        weight = _pad_to(weight.float(), 1, GROUP_SIZE)
        out_features, width = weight.shape
        groups = weight.view(out_features, width // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        return cls(q.view(out_features, width), scale, low + 8 * scale, in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) -> [rows, out], in x's dtype."""
        inputs = self._prepare(x)
        rows = x.shape[0]
        if quant_matmul.available():
            kernel = quant_matmul.int4_matmul if rows >= INT4_MANY_ROWS else quant_matmul.int4_matmul_few_rows
            out = kernel(inputs, self.packed, self.scales_zeros, x.dtype == torch.bfloat16)  # in x's dtype, or float32
            return self._finish(out, bias, x.dtype)
        dense = weight_unpack.unpack_int4(self.packed, self.scales_zeros) if rows >= DENSE_MIN_ROWS else None
        if dense is not None:
            return self._finish(F.linear(inputs, dense), bias, x.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(inputs, self.packed, GROUP_SIZE, self.scales_zeros)
        return self._finish(out, bias, x.dtype)

    def dequantize(self) -> torch.Tensor:  # float32 [out, in]
        """The values the kernel multiplies by (read back through the kernel itself, with an identity input)."""
        eye = torch.eye(self._padded_in, dtype=COMPUTE_DTYPE)
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, self.scales_zeros)
        return cols.float().T[: self.out_features, : self.in_features].contiguous()

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise QuantizationError("an int4 weight is not read by rows; keep the embedding table apart")

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


class Int8Weight(QuantizedWeight):
    """8-bit symmetric weights with one float scale per row (output feature)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """q int8 [out, in]; scale [out]; value = q * scale."""
        self.out_features, self.in_features = q.shape
        self.q = _pad_to(q.to(torch.int8), 1, INT8_COL_MULTIPLE).contiguous()
        self._padded_in = self.q.shape[1]
        self.scale = scale.float().contiguous()  # float32 [out]: exact row lookups
        self._kernel_scale = self.scale.to(COMPUTE_DTYPE)
        # kernels/quant_matmul's shape: outputs in 16s, inputs in 32s (true of LM heads; others keep torch's kernel)
        self._bf16_dot_shape = self.out_features % 16 == 0 and self._padded_in % GROUP_SIZE == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Round a float weight [out, in] to 8 bits, one scale per row (its largest magnitude / 127)."""
        weight = weight.float()
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        inputs = self._prepare(x)
        rows = x.shape[0]
        if rows <= INT8_BF16_DOT_MAX_ROWS and self._bf16_dot_shape and quant_matmul.available():
            return self._finish(quant_matmul.int8_matmul(inputs, self.q, self.scale, x.dtype == torch.bfloat16), bias,
                                x.dtype)
        dense = weight_unpack.unpack_int8(self.q, self.scale) if rows >= DENSE_MIN_ROWS else None
        if dense is not None:
            return self._finish(F.linear(inputs, dense), bias, x.dtype)
        out = torch._weight_int8pack_mm(inputs, self.q, self._kernel_scale)
        return self._finish(out, bias, x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.q[:, : self.in_features].float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.q[ids, : self.in_features].float() * self.scale[ids, None]).to(dtype)

    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 6


class EncodedRows:
    """An embedding table kept as the GGUF file encodes it; a lookup decodes only the rows asked for."""

    def __init__(self, raw: torch.Tensor, qtype: int, cols: int) -> None:
        """raw uint8 [rows, bytes per row], in ggml type `qtype` (runtime/model/ggml_blocks.py)."""
        self.raw, self.qtype, self.cols = raw, qtype, cols

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [len(ids), cols]
        from runtime.model import ggml_blocks

        picked = self.raw[ids.reshape(-1).cpu()].numpy()
        return ggml_blocks.dequantize(picked, self.qtype, (picked.shape[0], self.cols)).to(dtype)

    def nbytes(self) -> int:
        return self.raw.numel()


QUANTIZERS = {"int4": Int4Weight.quantize, "int8": Int8Weight.quantize}
