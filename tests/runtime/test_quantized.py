"""Weight-only int4 and int8 matmuls agree with dequantize-then-matmul, on odd shapes too; ggml's
4-bit blocks map onto the int4 layout exactly (to bfloat16 scales); `--quantization` on a folder.

Tolerance: the kernels take bfloat16 inputs and round their outputs to bfloat16, so each output
may differ from float64 x @ W.T (W the dequantized weight) by bfloat16's rounding of the input
(2^-8 relative, summed over the row) and of the output: |err| <= 2^-7 * (|x| @ |W|.T) + 2^-8 |ref|.
"""

import random

import numpy as np
import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.model import ggml_blocks, quantized
from runtime.model.quantized import Int4Weight, Int8Weight
from runtime.perplexity import perplexity

SHAPES = [(1, 32, 16), (3, 96, 37), (5, 80, 50), (9, 64, 48), (17, 200, 129), (40, 80, 70), (64, 576, 960),
          (70, 96, 130), (130, 64, 32)]  # rows, in, out
# the paths: where the CPU has AVX512-BF16, kernels/quant_matmul (int4: few rows below quantized.INT4_MANY_ROWS,
# many from there; int8: outputs a multiple of 16, up to INT8_BF16_DOT_MAX_ROWS rows); past that, or without
# AVX512-BF16 (forced below too), torch's kernels, and the unpack-then-bfloat16-matmul from DENSE_MIN_ROWS rows


def _check_close(out, x, weight):
    ref = x.double() @ weight.double().T
    bound = 2**-7 * (x.double().abs() @ weight.double().abs().T) + 2**-8 * ref.abs() + 1e-6
    assert out.shape == ref.shape
    assert torch.all((out.double() - ref).abs() <= bound), float(((out.double() - ref).abs() / bound).max())


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_agrees_with_dequantize_then_matmul(cls, rows, in_features, out_features, dtype):
    torch.manual_seed(rows * 1000 + in_features)
    weight = cls.quantize(torch.randn(out_features, in_features) * 0.05)
    dense = weight.dequantize()
    assert dense.shape == (out_features, in_features)
    x = torch.randn(rows, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    out = weight.linear(x, bias)
    assert out.dtype == dtype
    _check_close(out - bias, x.float(), dense)


@pytest.mark.parametrize("rows,in_features,out_features", [(8, 64, 64), (64, 576, 960), (70, 96, 130)])
@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
def test_without_the_bf16_kernels_the_other_paths_agree_too(cls, rows, in_features, out_features, monkeypatch):
    """Where kernels/quant_matmul is not built (no AVX512-BF16), torch's kernels and the unpack serve."""
    monkeypatch.setattr(quantized.quant_matmul, "available", lambda: False)
    torch.manual_seed(rows + out_features)
    weight = cls.quantize(torch.randn(out_features, in_features) * 0.05)
    x = torch.randn(rows, in_features)
    _check_close(weight.linear(x), x, weight.dequantize())


@pytest.mark.parametrize("cls,step", [(Int4Weight, 1 / 15), (Int8Weight, 1 / 127)])
def test_quantize_rounds_each_weight_to_its_nearest_level(cls, step):
    torch.manual_seed(0)
    weight = torch.randn(48, 96)
    error = (cls.quantize(weight).dequantize() - weight).abs()
    if cls is Int4Weight:  # per 32 inputs: half a level of (max - min) / 15, plus bfloat16's scale rounding
        groups = weight.view(48, 3, 32)
        span = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, dim=1)
        assert torch.all(error <= span * (step / 2 + 2**-7))
    else:
        assert torch.all(error <= weight.abs().amax(1, keepdim=True) * step / 2 * 1.001)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_ggml_4bit_blocks_map_onto_int4_exactly_up_to_bfloat16_scales(type_name):
    import gguf

    rng = np.random.default_rng(1)
    qtype = int(gguf.GGMLQuantizationType[type_name])
    values = rng.standard_normal((40, 160)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    ggml = ggml_blocks.dequantize(raw, qtype, (40, 160))
    weight = Int4Weight.from_q4(*ggml_blocks.unpack_q4(raw, qtype, 40, 160))
    # the only change: each block's float16 scale and offset rounded to bfloat16 (8 bits of mantissa)
    q, d, m = ggml_blocks.unpack_q4(raw, qtype, 40, 160)
    d16, zero16 = d.bfloat16().float(), (m + 8 * d).bfloat16().float()
    expected = (q.float().view(40, 5, 32) - 8) * d16[..., None] + zero16[..., None]
    assert torch.allclose(weight.dequantize(), expected.view(40, 160), rtol=2**-8, atol=1e-6)
    assert (weight.dequantize() - ggml).abs().max() <= 2**-7 * ggml.abs().max()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantization_flag_on_a_float_folder(random_checkpoints, mode):
    path = random_checkpoints["llama-gqa"]
    dense = Engine.from_pretrained(path, num_blocks=64, block_size=8)
    engine = Engine.from_pretrained(path, num_blocks=64, block_size=8, quantization=mode, dtype="bfloat16")
    model = engine.runner.model
    expected = Int8Weight if mode == "int8" else Int4Weight
    assert all(isinstance(getattr(m, f"{n}_packed"), expected) for m, n in model.linear_slots())
    assert isinstance(model.lm_head_packed, Int8Weight)  # bfloat16 engine: the head in 8 bits in both modes
    assert model.weight_bytes() < dense.runner.model.weight_bytes() / (3 if mode == "int8" else 4)
    rng = random.Random(mode)
    tokens = [1] + [rng.randrange(3, 512) for _ in range(200)]
    reference, quantized = perplexity(dense, tokens), perplexity(engine, tokens)
    assert abs(quantized - reference) / reference < {"int8": 0.01, "int4": 0.05}[mode]


def test_quantization_on_cuda_is_a_clear_error():
    from runtime.model.config import UnsupportedModelError
    from runtime.model.quantize import check_quantization

    with pytest.raises(UnsupportedModelError, match="CPU only"):
        check_quantization("int4", torch.device("cuda"))
    check_quantization("auto", torch.device("cuda"))  # GGUF weights are dequantized there
    with pytest.raises(UnsupportedModelError, match="not one of"):
        check_quantization("int3", torch.device("cpu"))
