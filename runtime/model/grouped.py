"""A matmul weight kept in the GGUF file's own groups, computed as the file says.

    GroupedWeight  value = int(code) * scale[group] (+ zero[group]), the file's values exactly
                   grouped4: 4-bit codes read through a 16-entry int8 table, groups of 32
                             (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS)
                   grouped6: int8 codes in [-32, 31] kept in 6 bits, groups of 32 or 16
                             (Q5_0, Q5_1, Q5_K; Q6_K per 16; chosen by the codes, so a tensor of any
                             8-bit type whose codes all fit, as an all-zero Q8_0 one's do, too)
                   grouped8: int8 codes, groups of 32 (Q8_0)

The codes, scales and zeros come from runtime/model/ggml_blocks.unpack_groups, which computes
the scales in float32 as ggml does (d * sc, dmin * m), so int * scale + zero is ggml's value
to the bit, and nothing is re-quantized. A matmul (kernels/grouped_matmul.py) takes float32
activations (a bfloat16 input is widened, the result rounded back) and sums in float32, in
the C++ kernel (one arithmetic for any number of rows: a prefix-cache hit computes what a cold
prompt does), or where it cannot build, by torch ops on blocks of the same values.

The K-quants' scales stay factored as the file has them (kernels/grouped_matmul.Factored: an
int8 per group times one float16 unit, the file's own d or dmin, per 256 values), so Q4_K takes 4.625
bits a weight (the file's 4.5), not 6. The
others' f16 scales (and Q4_1's mins) are kept as float16 where float16 holds every one exactly
(grouped_matmul.narrowed; always, for a file's own f16): Q4_0 takes the file's 4.5 bits, not 5.

A matrix stacked from GGUF tensors of different kinds (Q4_K_M keeps some attn_v in Q6_K beside
Q4_K q and k) keeps each run of one kind in its own form, called apart (SplitGroupedWeight): one
form for all would give the Q4_K rows int8 codes per 16, 9.125 bits a weight instead of 4.625.
"""

from __future__ import annotations

import torch

from kernels import grouped_matmul
from kernels.grouped_matmul import Factored, Scales
from runtime.model.ggml_blocks import Groups
from runtime.model.quantized import QuantizationError, QuantizedWeight

NIBBLE_GROUP = 32  # inputs per group of 4-bit codes


def _cat(parts: list[Scales]) -> Scales:
    """Row blocks' scales as one: factored when all are, with runs of groups of one length; else float32."""
    if all(isinstance(p, Factored) for p in parts) and len({p.per_unit for p in parts}) == 1:
        return Factored(torch.cat([p.ints for p in parts]), torch.cat([p.units for p in parts]))
    return torch.cat([grouped_matmul.floats(p) for p in parts])


def _same_kind(a: Groups, b: Groups) -> bool:
    """Whether two row blocks stack as they are (one code kind, group, table and zero presence)."""
    return (a.group == b.group and (a.zero is None) == (b.zero is None) and (a.table is None) == (b.table is None)
            and (a.table is None or torch.equal(a.table, b.table)))


def _stack(parts: list[Groups]) -> Groups:
    """Row blocks of one kind (`_same_kind`) as one Groups, in order."""
    first = parts[0]
    if not all(_same_kind(first, p) for p in parts):
        raise QuantizationError("row blocks of different kinds are kept apart (SplitGroupedWeight), not stacked")
    zero = None if first.zero is None else _cat([p.zero for p in parts])
    return Groups(torch.cat([p.codes for p in parts]), _cat([p.scale for p in parts]), zero, first.group, first.table)


def _contiguous(scale: Scales) -> Scales:
    if isinstance(scale, Factored):
        return scale.map(torch.Tensor.contiguous)
    return scale.float().contiguous()


class GroupedWeight(QuantizedWeight):
    """A [out_features, in_features] weight in ggml's groups; `linear` is x @ W.T + bias in float32 sums."""

    def __init__(self, groups: Groups) -> None:
        out_features, in_features = groups.codes.shape
        scale_shape = tuple((groups.scale.ints if isinstance(groups.scale, Factored) else groups.scale).shape)
        if in_features % groups.group or scale_shape != (out_features, in_features // groups.group):
            raise QuantizationError(f"grouped weight [{out_features}, {in_features}] needs scales "
                                    f"[{out_features}, {in_features // groups.group}], got {scale_shape}")
        self.out_features = out_features
        self.in_features = self._padded_in = in_features
        self.group = groups.group
        self.table = groups.table  # int8 [16], or None for int8 codes
        if groups.table is not None and groups.group != NIBBLE_GROUP:
            raise QuantizationError(f"4-bit codes come in groups of {NIBBLE_GROUP}, not {groups.group}")
        ints = groups.codes.contiguous().view(torch.uint8).view(out_features, in_features // groups.group, groups.group)
        # float32 [out, in // group]; float16 where that is exact (the f16 the file stores); or Factored
        scale = grouped_matmul.narrowed(_contiguous(groups.scale))
        zero = None if groups.zero is None else grouped_matmul.narrowed(_contiguous(groups.zero))
        # the kernel's vector loops read panels of 16 outputs: outputs of zeros (codes, scales and zeros) fill
        # the last one, and linear / dequantize cut them off
        self.padded_outputs = -out_features % grouped_matmul.PANEL
        if self.padded_outputs:
            ints, scale, zero = grouped_matmul.padded(ints, scale, zero, self.padded_outputs)
        # 4-bit codes as nibbles; 8-bit ones in 6 bits where they fit (Q5_x's and Q6_K's always do: Q6_K takes the
        # file's 6.5625 bits a weight instead of 8.5625)
        bits = 4 if self.table is not None else 6 if grouped_matmul.fits_six_bits(ints) else 8
        # codes [out / 16, in // group, 16 * group bytes], scale and zero [out / 16, in // group, 16]
        self.codes, self.scale, self.zero = grouped_matmul.panels_of_ints(ints, bits, scale, zero)
        self.form = f"grouped{bits}"
        self._kernel = None  # grouped_matmul.kernel_call for these tensors once first used (False: no C++ kernel)

    @classmethod
    def from_groups(cls, parts: list[Groups]) -> GroupedWeight | SplitGroupedWeight:
        """One weight from the row blocks of a matrix (runtime/model/ggml_blocks.unpack_groups each), in order:
        runs of one kind stacked, and a SplitGroupedWeight where the kinds differ."""
        runs: list[list[Groups]] = []
        for part in parts:
            if runs and _same_kind(runs[-1][-1], part):
                runs[-1].append(part)
            else:
                runs.append([part])
        if len(runs) == 1:
            return cls(_stack(parts))
        return SplitGroupedWeight([cls(_stack(run)) for run in runs], [len(run) for run in runs])

    def _args(self) -> tuple:
        return self.codes, self.scale, self.zero, self.table

    def kernel_arguments(self) -> tuple:
        """The C++ kernel's arguments after x, as grouped_matmul.kernel_call passes them (the native decode step's)."""
        return grouped_matmul.kernel_arguments(*self._args())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) -> [rows, out], in x's dtype (computed in float32)."""
        if self._kernel is None:
            self._kernel = grouped_matmul.kernel_call(*self._args()) if grouped_matmul.available() else False
        inputs = x if x.dtype == torch.float32 else x.float()  # [rows, in]
        if self._kernel:
            out = self._kernel(inputs)
        else:
            out = grouped_matmul.grouped_matmul_torch(inputs.contiguous(), *self._args())
        if self.padded_outputs:
            out = out[:, :self.out_features].contiguous()
        # a float32 decode step (~120 calls) returns here: nothing to cast or add
        return out if bias is None and x.dtype == torch.float32 else self._finish(out, bias, x.dtype)

    def dequantize(self) -> torch.Tensor:  # float32 [out, in], the file's values
        return grouped_matmul.grouped_values(*self._args())[:self.out_features]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [len(ids), in]
        """Rows `ids` of the weight (an embedding lookup from the LM head's table), the file's values."""
        ids = ids.reshape(-1).cpu()
        if grouped_matmul.available():  # [len(ids), in] float32, from each id's own bytes
            return grouped_matmul.grouped_rows(self.codes, self.scale, self.zero, self.table, ids).to(dtype)
        codes, scale, zero = grouped_matmul.select_rows(self.codes, self.scale, self.zero, ids)
        return grouped_matmul.grouped_values(codes, scale, zero, self.table).to(dtype)

    def nbytes(self) -> int:
        return self.codes.numel() + grouped_matmul.scales_nbytes(self.scale) + grouped_matmul.scales_nbytes(self.zero)


class SplitGroupedWeight(QuantizedWeight):
    """A matrix whose row blocks are GroupedWeights of different kinds, each called apart, outputs side by side."""

    def __init__(self, parts: list[GroupedWeight], pieces: list[int]) -> None:
        if len({p.in_features for p in parts}) != 1:
            raise QuantizationError(f"row blocks of one matrix with different widths: {[p.in_features for p in parts]}")
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = self._padded_in = parts[0].in_features
        self.piece_forms = [part.form for part, count in zip(parts, pieces) for _ in range(count)]  # per file tensor
        self.form = "+".join(sorted(set(self.piece_forms)))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) -> [rows, out] in x's dtype: each block's outputs, as GroupedWeight gives them."""
        out = torch.cat([part.linear(x) for part in self.parts], dim=1)  # [rows, out]
        return out if bias is None else out + bias

    def dequantize(self) -> torch.Tensor:  # float32 [out, in], the file's values
        return torch.cat([part.dequantize() for part in self.parts])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise QuantizationError("a split weight is a layer's matmul, never an embedding table")

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)
