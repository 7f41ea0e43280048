"""Every ggml type llama.cpp's reader dequantizes is read, bit for bit as it reads it; the types kept in
their own groups (runtime/model/grouped.py) multiply as dequantize-then-matmul does, on odd shapes; a
GGUF model in each such type, and one mixing them as Q4_K_M does, loaded with quantization="auto" gives
the greedy tokens of the same file dequantized to float32 ("none") up to near-ties (the kernel's int8
activations against float32), and the load log names each type's form.

Matmul bound: the grouped weights are the file's float32 values exactly and x is rounded to the kernel's
int8 blocks (kernels/grouped_matmul.rounded_activations: per group, or per unit of 256 for the K-quants'
factored scales), so the only error is float32 arithmetic
(tests/kernels/test_grouped_matmul.py derives it): (K / G + 6) * 2^-24 of |x| @ (|W - zero| + |zero|).T
per output, plus the bias's addition (2^-24 of |ref|); a bfloat16 result adds its rounding, 2^-8 of |ref|.
"""

import numpy as np
import pytest
import structlog
import torch

from kernels import grouped_matmul
from runtime import Engine, SamplingParams
from runtime.model import ggml_blocks, grouped
from runtime.model.grouped import GroupedWeight, SplitGroupedWeight
from runtime.model.quantized import QuantizationError
from tests.gguf_files import encoded_blocks, q4_k_m_type, retyped, write_gguf

GROUPED = ("Q4_0", "Q4_1", "IQ4_NL", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
FORMS = {"Q4_0": "grouped4", "Q4_1": "grouped4", "IQ4_NL": "grouped4", "Q4_K": "grouped4", "IQ4_XS": "grouped4",
         "Q5_0": "grouped6", "Q5_1": "grouped6", "Q8_0": "grouped8", "Q5_K": "grouped6", "Q6_K": "grouped6"}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)  # the chosen token, then the top 5
PROMPTS = [[1, 45, 300, 22, 99, 7], [1] + list(range(60, 101))]


# --- reading: bit for bit with llama.cpp's reader ---------------------------------------------

@pytest.mark.parametrize("type_name", [name for name in ggml_blocks.TYPE_NAMES.values() if name not in ("F32", "F16", "BF16")])
def test_every_readable_type_dequantizes_bit_for_bit(type_name):
    import gguf

    rng = np.random.default_rng(sum(map(ord, type_name)))
    qtype = gguf.GGMLQuantizationType[type_name]
    per_block = gguf.GGML_QUANT_SIZES[qtype][0]
    shapes = [(1, 256), (7, 512), (33, 768)] + ([(5, 576), (3, 192)] if per_block == 32 else [])
    for rows, cols in shapes:
        raw = encoded_blocks(type_name, rows, cols, rng)
        ours = ggml_blocks.dequantize(raw, int(qtype), (rows, cols))
        with np.errstate(all="ignore"):
            ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
        assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
        assert torch.equal(ours.view(torch.int32), ref.reshape(rows, cols).view(torch.int32))


@pytest.mark.parametrize("type_name", GROUPED)
def test_groups_hold_the_file_values(type_name):
    """codes * scale (+ zero) is dequantize's result bit for bit, and the codes are small integers."""
    rng = np.random.default_rng(1)
    qtype = int(ggml_blocks.GGMLQuantizationType[type_name])
    raw = encoded_blocks(type_name, 6, 512, rng)
    groups = ggml_blocks.unpack_groups(raw, qtype, 6, 512)
    assert groups.group == (16 if type_name == "Q6_K" else 32)
    assert (groups.table is not None) == (FORMS[type_name] == "grouped4")
    assert torch.equal(GroupedWeight(groups).dequantize().view(torch.int32),
                       ggml_blocks.dequantize(raw, qtype, (6, 512)).view(torch.int32))


# --- the grouped matmul, as the model calls it -----------------------------------------------

def _check_close(out, x, weight: GroupedWeight, dtype, bias=None, rounded=True):
    """out within float32 arithmetic of x @ W.T (+ bias) in float64, x rounded to the kernel's int8
    blocks when `rounded` (the C++ kernel; the torch path multiplies x as it is)."""
    group, span = weight.group, grouped_matmul.activation_span(weight.codes, weight.scale, weight.zero, weight.table)
    inputs = grouped_matmul.rounded_activations(x, span) if rounded else x.double()  # K-quants: a block a unit
    ref = inputs @ weight.dequantize().double().T + (0 if bias is None else bias.double())
    cut = lambda values: values[:weight.out_features]  # noqa: E731  (outputs padded to a multiple of 16 dropped)
    codes, scale, zero = grouped_matmul.to_rows(weight.codes, weight.scale, weight.zero)
    codes, scale, zero = cut(codes), grouped_matmul.each(scale, cut), None if zero is None else grouped_matmul.each(zero, cut)
    values = grouped_matmul.grouped_values(codes, scale, None, weight.table, dtype=torch.float64).abs()
    if zero is not None:
        values = values + grouped_matmul.floats(zero).double().abs().repeat_interleave(group, dim=1)
    magnitude = inputs.abs() @ values.T
    steps = (x.shape[1] / group + 6) if rounded else (x.shape[1] / 8 + 3)
    bound = steps * 2**-24 * magnitude + (2**-8 if dtype == torch.bfloat16 else 2**-24) * ref.abs()
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.all((out.double() - ref).abs() <= bound + 1e-30), float(((out.double() - ref).abs() / magnitude).max())


@pytest.mark.parametrize("type_name", GROUPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_agrees_with_dequantize_then_matmul(type_name, dtype):
    rng = np.random.default_rng(2)
    qtype = int(ggml_blocks.GGMLQuantizationType[type_name])
    widths = (512, 768) if ggml_blocks.BLOCK_VALUES[qtype] == 256 else (576, 192)
    for out_features, in_features in ((37, widths[0]), (130, widths[1])):
        weight = GroupedWeight.from_groups([ggml_blocks.unpack_groups(
            encoded_blocks(type_name, out_features, in_features, rng), qtype, out_features, in_features)])
        for rows in (1, 3, 9, 17, 40):
            x = torch.randn(rows, in_features).to(dtype)
            bias = torch.randn(out_features) if dtype == torch.float32 else None  # bfloat16: one rounding, not two
            _check_close(weight.linear(x, bias), x.float(), weight, dtype, bias)


def test_without_the_cpp_kernel_the_torch_path_agrees(monkeypatch):
    monkeypatch.setattr(grouped_matmul, "available", lambda: False)
    rng = np.random.default_rng(3)
    weight = GroupedWeight.from_groups([ggml_blocks.unpack_groups(encoded_blocks("Q4_K", 45, 512, rng), ggml_blocks.Q4_K,
                                                                  45, 512)])
    x = torch.randn(5, 512)
    _check_close(weight.linear(x), x, weight, torch.float32, rounded=False)


@pytest.mark.parametrize("type_name, rows", [("Q6_K", 20), ("Q6_K", 48), ("Q4_K", 48), ("Q4_0", 32)])
def test_rows_are_the_file_values(type_name, rows):
    """An embedding lookup from a tied head's table, from panels (20 outputs: the last panel padded)."""
    rng = np.random.default_rng(4)
    qtype = int(ggml_blocks.GGMLQuantizationType[type_name])
    raw = encoded_blocks(type_name, rows, 256, rng)
    weight = GroupedWeight.from_groups([ggml_blocks.unpack_groups(raw, qtype, rows, 256)])
    assert weight.codes.dim() == 3 and weight.padded_outputs == -rows % 16
    ids = torch.tensor([3, 0, rows - 1, 3, 17])
    assert torch.equal(weight.rows(ids, torch.float32), ggml_blocks.dequantize(raw, qtype, (rows, 256))[ids])


def test_a_matrix_stacked_from_different_types_keeps_every_value():
    """Q4_K_M's fused q/k/v: Q4_K q and k beside a Q6_K v: each run of one kind in its own form, called apart
    (q and k stacked as 4-bit codes, v and a Q5_0 block as int8 codes in 6 bits), every value the file's; blocks of
    different kinds are never stacked into one form."""
    rng = np.random.default_rng(5)
    parts = [("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32), ("Q5_0", 16)]
    raws = [(encoded_blocks(name, rows, 256, rng), int(ggml_blocks.GGMLQuantizationType[name]), rows) for name, rows in parts]
    groups = [ggml_blocks.unpack_groups(raw, qtype, rows, 256) for raw, qtype, rows in raws]
    weight = GroupedWeight.from_groups(groups)
    expected = torch.cat([ggml_blocks.dequantize(raw, qtype, (rows, 256)) for raw, qtype, rows in raws])
    assert isinstance(weight, SplitGroupedWeight)
    assert [(p.form, p.out_features, p.group) for p in weight.parts] == [("grouped4", 96, 32), ("grouped6", 32, 16),
                                                                         ("grouped6", 16, 32)]
    assert weight.piece_forms == ["grouped4", "grouped4", "grouped6", "grouped6"] and weight.out_features == 144
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(3, 256)
    out = weight.linear(x, bias=torch.ones(144))
    start = 0
    for part in weight.parts:  # each block within its own kernel's bound, the bias added once
        _check_close(out[:, start:start + part.out_features] - 1, x, part, torch.float32)
        start += part.out_features
    with pytest.raises(QuantizationError, match="kept apart"):
        grouped._stack(groups)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q6_K"])
def test_outputs_not_a_multiple_of_16_fill_their_last_panel(type_name):
    """37 outputs (a vocabulary of 32,001, say) padded with outputs of zeros to panels, so the vector loops read
    them: the first 37 outputs are the row layout's (the plain loop's) to the bit, and the values the file's."""
    rng = np.random.default_rng(9)
    qtype = int(ggml_blocks.GGMLQuantizationType[type_name])
    raw = encoded_blocks(type_name, 37, 512, rng)
    weight = GroupedWeight.from_groups([ggml_blocks.unpack_groups(raw, qtype, 37, 512)])
    assert weight.codes.dim() == 3 and weight.padded_outputs == 11
    assert torch.equal(weight.dequantize(), ggml_blocks.dequantize(raw, qtype, (37, 512)))
    cut = lambda values: values[:37]  # noqa: E731
    codes, scale, zero = grouped_matmul.to_rows(weight.codes, weight.scale, weight.zero)
    rows = (cut(codes), grouped_matmul.each(scale, cut), None if zero is None else grouped_matmul.each(zero, cut))
    for count in (1, 6):
        x = torch.randn(count, 512)
        out = weight.linear(x)
        assert out.shape == (count, 37) and out.is_contiguous()
        assert torch.equal(out, grouped_matmul.grouped_matmul(x, *rows, weight.table))


@pytest.mark.parametrize("type_name, bits", [("Q4_0", 4.5), ("Q4_1", 5.0), ("Q8_0", 8.5), ("Q5_0", 6.5), ("Q5_1", 7.0)])
def test_f16_scales_stay_float16(type_name, bits):
    """The f16 scale (and min) of Q4_0, Q4_1, Q8_0 and Q5_x is kept as float16: the file's 4.5 bits a weight for
    Q4_0 (float32 scales took 5), its values to the bit; Q5_x's codes in 6 bits (8 took 8.5 and 9)."""
    rng = np.random.default_rng(7)
    qtype = int(ggml_blocks.GGMLQuantizationType[type_name])
    raw = encoded_blocks(type_name, 48, 512, rng)
    weight = GroupedWeight.from_groups([ggml_blocks.unpack_groups(raw, qtype, 48, 512)])
    assert weight.scale.dtype == torch.float16 and (weight.zero is None or weight.zero.dtype == torch.float16)
    assert weight.nbytes() * 8 / (48 * 512) == bits
    assert torch.equal(weight.dequantize(), ggml_blocks.dequantize(raw, qtype, (48, 512)))
    x = torch.randn(3, 512)
    _check_close(weight.linear(x), x, weight, torch.float32)


def test_k_quant_scales_stay_factored_and_small():
    """Q4_K's scales and zeros are kept as the file has them (6-bit ints, the file's f16 unit per 256 values):
    4.625 bits a weight (the file's 4.5), not 6, and Q6_K's: the file's 6.5625 (its codes in 6 bits); the values
    are the file's."""
    rng = np.random.default_rng(6)
    raw = encoded_blocks("Q4_K", 64, 512, rng)
    weight = GroupedWeight.from_groups([ggml_blocks.unpack_groups(raw, ggml_blocks.Q4_K, 64, 512)])
    assert isinstance(weight.scale, grouped_matmul.Factored) and isinstance(weight.zero, grouped_matmul.Factored)
    assert weight.scale.units.dtype == torch.float16 and weight.nbytes() * 8 / (64 * 512) == 4.625
    assert torch.equal(weight.dequantize(), ggml_blocks.dequantize(raw, ggml_blocks.Q4_K, (64, 512)))
    raw = encoded_blocks("Q6_K", 32, 512, rng)
    six = GroupedWeight.from_groups([ggml_blocks.unpack_groups(raw, ggml_blocks.Q6_K, 32, 512)])
    assert isinstance(six.scale, grouped_matmul.Factored) and six.zero is None and six.group == 16
    assert six.form == "grouped6" and six.nbytes() * 8 / (32 * 512) == 6.5625
    raw_five = encoded_blocks("Q5_K", 32, 512, rng)  # 6-bit codes, int8 scales and mins per 32, two units per 256
    five = GroupedWeight.from_groups([ggml_blocks.unpack_groups(raw_five, ggml_blocks.Q5_K, 32, 512)])
    assert five.form == "grouped6" and five.nbytes() * 8 / (32 * 512) == 6.625
    assert torch.equal(five.dequantize(), ggml_blocks.dequantize(raw_five, ggml_blocks.Q5_K, (32, 512)))
    assert torch.equal(six.dequantize(), ggml_blocks.dequantize(raw, ggml_blocks.Q6_K, (32, 512)))
    x = torch.randn(2, 512)
    _check_close(six.linear(x), x, six, torch.float32)


# --- whole models: auto (each type in its form) gives the tokens of the dequantized file -----------

def _hf_model(tied: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
                         tie_word_embeddings=tied)
    torch.manual_seed(int(tied))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.fixture(scope="module")
def f32_files(tmp_path_factory, stories_dir):
    folder = tmp_path_factory.mktemp("ggml-types")
    return folder, {tied: write_gguf(folder / f"f32-{tied}.gguf", _hf_model(tied), "llama", "F32",
                                     stories_dir / "tokenizer.model") for tied in (False, True)}


# The grouped kernel rounds activations to int8 per block (2^-8 of the block's largest value, llama.cpp's
# arithmetic) where the dequantized file multiplies them in float32: on these random models the chosen
# tokens' logprobs then differ by up to 0.19 nats (measured over every type here). A broken form (a wrong
# layout, scale or tie) moves them by whole nats from the first token.
LOGPROB_SLACK = 0.3  # nats


def _assert_the_dequantized_files_greedy_up_to_near_ties(auto, dense):
    """auto's greedy tokens are dense's, each chosen logprob within the slack, until a step where dense's two
    best lie within twice the slack and auto took the other (a near-tie the rounding may flip)."""
    for ours, theirs in zip(auto.generate(PROMPTS, GREEDY), dense.generate(PROMPTS, GREEDY),
                            strict=True):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        for step, (token, expected) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True)):
            if token != expected:
                assert token in theirs.logprobs[step], (step, token, theirs.logprobs[step])
                assert theirs.logprobs[step][expected] - theirs.logprobs[step][token] <= 2 * LOGPROB_SLACK, step
                break
            assert abs(ours.logprobs[step][token] - theirs.logprobs[step][token]) <= LOGPROB_SLACK, step


@pytest.mark.parametrize("type_name,tied", [("Q5_0", False), ("Q5_1", False), ("Q8_0", False), ("Q4_K", False),
                                            ("Q6_K", True), ("IQ4_NL", False), ("Q4_0", True), ("mixed", False)])
def test_auto_gives_the_tokens_of_the_dequantized_file(f32_files, type_name, tied):
    folder, sources = f32_files
    type_of = q4_k_m_type if type_name == "mixed" else (lambda name: type_name)
    path = retyped(sources[tied], folder / f"{type_name}-{tied}.gguf", type_of)
    with structlog.testing.capture_logs() as logs:
        auto = Engine.from_pretrained(path, quantization="auto", num_blocks=64, block_size=8)
    dense = Engine.from_pretrained(path, quantization="none", num_blocks=64, block_size=8)
    model = auto.runner.model
    kinds = {type(getattr(m, f"{n}_packed")).__name__ for m, n in model.linear_slots()}
    assert kinds == ({"GroupedWeight", "SplitGroupedWeight"} if type_name == "mixed" else {"GroupedWeight"})
    assert isinstance(model.lm_head_packed, GroupedWeight)
    if tied:  # the embedding rows come from the LM head's own groups
        assert model.embed_rows is model.lm_head_packed
    forms = next(entry["forms"] for entry in logs if entry["event"] == "GGUF loaded")
    # an untied embedding table is kept in the file's blocks, its rows decoded as looked up ("rows"); the mix
    # stacks Q4_K q and k with a Q6_K v: each kept in its own form, called apart
    expected = {"F32": "dense", **({"Q4_K": "grouped4", "Q6_K": "grouped6", "Q5_0": "grouped6", "Q8_0": "rows"}
                                   if type_name == "mixed" else {type_name: FORMS[type_name] + ("" if tied else "+rows")})}
    assert forms == expected
    assert model.weight_bytes() < dense.runner.model.weight_bytes() / 2.5
    _assert_the_dequantized_files_greedy_up_to_near_ties(auto, dense)
