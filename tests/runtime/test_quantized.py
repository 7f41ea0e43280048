"""Weight-only int4 and int8 matmuls agree with dequantize-then-matmul, on odd shapes too; ggml's
4-bit blocks map onto the int4 layout exactly (to bfloat16 scales); `--quantization` on a folder.

Tolerance: the matmul tests build weights and inputs that bfloat16 holds exactly, and check the
bound tests/runtime/quant_checks.py derives: float32 accumulation and the output's rounding to
bfloat16, nothing for the inputs' or weights' rounding. For int4 that bound
is several times smaller than one weight one level off, and test_one_weight_one_level_off_fails_the_check
shows it on every path: a bound that admitted a wrong nibble could not catch one.
"""

import random

import numpy as np
import pytest
import torch

from runtime import Engine
from runtime.model import ggml_blocks, quantized
from runtime.model.quantized import Int4Weight, Int8Weight
from runtime.perplexity import perplexity
from tests.runtime.quant_checks import exact_input, exact_weight, within_bound

SHAPES = [(1, 32, 16), (3, 96, 37), (5, 80, 50), (9, 64, 48), (17, 200, 129), (40, 80, 70), (64, 576, 960),
          (70, 96, 130), (130, 64, 32), (130, 576, 96)]  # rows, in, out
# the paths: where the CPU has AVX512-BF16, kernels/quant_matmul (int4: few rows below quantized.INT4_MANY_ROWS,
# many from there; int8: outputs a multiple of 16, up to INT8_BF16_DOT_MAX_ROWS rows); past that, or without
# AVX512-BF16 (forced below too), torch's kernels, and the unpack-then-bfloat16-matmul from DENSE_MIN_ROWS rows
PATH_ROWS = (1, quantized.DENSE_MIN_ROWS, quantized.INT4_MANY_ROWS + 2)  # one shape per path, both kernel sets


@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_matmul_agrees_with_dequantize_then_matmul(cls, rows, in_features, out_features, dtype):
    seed = rows * 1000 + in_features
    weight, values, _ = exact_weight(cls, out_features, in_features, seed)
    assert torch.equal(weight.dequantize().double(), values)
    x = exact_input(rows, in_features, seed, dtype)
    out = weight.linear(x)
    assert out.dtype == dtype
    within, worst = within_bound(out, x, values)
    assert within, worst
    bias = torch.randn(out_features).to(dtype)
    assert torch.equal(weight.linear(x, bias), out + bias)


@pytest.mark.parametrize("rows,in_features,out_features", [(8, 64, 64), (64, 576, 960), (70, 96, 130)])
@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
def test_without_the_bf16_kernels_the_other_paths_agree_too(cls, rows, in_features, out_features, monkeypatch):
    """Where kernels/quant_matmul is not built (no AVX512-BF16), torch's kernels and the unpack serve."""
    monkeypatch.setattr(quantized.quant_matmul, "available", lambda: False)
    weight, values, _ = exact_weight(cls, out_features, in_features, rows + out_features)
    x = exact_input(rows, in_features, rows, torch.float32)
    within, worst = within_bound(weight.linear(x), x, values)
    assert within, worst


@pytest.mark.parametrize("bf16_kernels", [True, False])
@pytest.mark.parametrize("rows", PATH_ROWS)
@pytest.mark.parametrize("cls", [Int4Weight, Int8Weight])
def test_one_weight_one_level_off_fails_the_check(cls, rows, bf16_kernels, monkeypatch):
    """The bound above can fail: a weight one level (one nibble step, one int8 step) from the one computed
    exceeds it, on every path. The column with the largest input meets that weight."""
    if not bf16_kernels:
        monkeypatch.setattr(quantized.quant_matmul, "available", lambda: False)
    # an int8 row of 576 inputs sums to ~1,700 levels; bfloat16's 8 bits cannot show one of them, so 32 inputs
    in_features, out_features = (576, 64) if cls is Int4Weight else (32, 64)
    weight, values, steps = exact_weight(cls, out_features, in_features, 7)
    x = exact_input(rows, in_features, 8, torch.float32)
    assert within_bound(weight.linear(x), x, values)[0]
    column = int(x.abs().amax(0).argmax())
    # int4: any output (the 6th); int8: the output nearest 0 in the first row, where bfloat16 has digits to spare
    output = 5 if cls is Int4Weight else int((x[:1].double() @ values.T).abs().argmin())
    off = values.clone()
    off[output, column] += steps[output, column]
    within, worst = within_bound(weight.linear(x), x, off)
    assert not within, f"one level off passed the check (worst error / bound {worst:.2f})"


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
