"""GGUF files the tests write themselves: a Hugging Face model's weights, encoded as llama.cpp does.

`write_gguf` lays a transformers model out the way llama.cpp's converter would: its tensor
names, q/k rows permuted for Llama-family rope, each matrix in the asked ggml type
(gguf.quants encodes F16, BF16, Q8_0, Q4_0 and Q4_1; for the K-quants, which gguf cannot
encode, random blocks with small finite scales stand in: any bytes are a valid K-quant), and
stories260K's sentencepiece vocabulary with a ChatML template. Reading the file back is the
job of the code under test and of transformers (the reference). `family_gguf` writes the test
checkpoint of a further family so; `retyped` rewrites a file with each matrix in a type of its own
(`q4_k_m_type`: llama.cpp's Q4_K_M mix), its blocks from `encoded_blocks`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from runtime.model import ggml_blocks

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
K_QUANT_BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # bytes per block of 256 values


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows: each head's rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _f16_bytes(values: np.ndarray) -> np.ndarray:  # float [...] -> uint8 [..., 2]
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_k_quant_blocks(rows: int, cols: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of random K-quant blocks whose values center on zero.

    Q6_K is symmetric already (d * scale * (q - 32)). Q4_K and Q5_K compute d * sc * q - dmin * m:
    every byte of the 12 packed 6-bit (sc, m) pairs gets equal nibbles, which makes sc == m in all
    eight sub-blocks, and dmin = d * 7.5 (15.5 for 5 bits) centres q's range on zero.
    """
    blocks = rng.integers(0, 256, size=(rows, cols // 256, K_QUANT_BLOCK[type_name]), dtype=np.uint8)
    d = rng.uniform(0.0004, 0.001, size=(rows, cols // 256))
    if type_name == "Q6_K":
        blocks[..., 208:210] = _f16_bytes(d / 8)
        return blocks.reshape(rows, -1)
    half_range = 7.5 if type_name == "Q4_K" else 15.5
    d16 = d.astype(np.float16).astype(np.float64)
    blocks[..., 0:2] = _f16_bytes(d16)
    blocks[..., 2:4] = _f16_bytes(d16 * half_range)
    blocks[..., 4:16] = (rng.integers(1, 4, size=(rows, cols // 256, 1)) * 0x11).astype(np.uint8)
    return blocks.reshape(rows, -1)


def _encode(name: str, weight: np.ndarray, type_name: str, rng):
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if weight.ndim == 1 or type_name == "F32":
        return weight.astype(np.float32), None
    if type_name == "F16":
        return weight.astype(np.float16), None
    if type_name in K_QUANT_BLOCK:
        return random_k_quant_blocks(*weight.shape, type_name, rng), qtype
    return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype


def sentencepiece_vocab(tokenizer_model: Path) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, llama.cpp token types) of a sentencepiece model."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    pieces, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        pieces.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    return pieces, scores, types


def _llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:  # float32 [head_dim // 2]
    """Llama 3.1's scaled rope as llama.cpp's converter writes it: each pair's divisor (rope_freqs)."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _family_metadata(writer, arch: str, config, rope: dict, omit: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The metadata a family adds (as llama.cpp's converter writes it); returns the extra tensors it needs.

    `omit`: keys of Gemma's left out (sliding_window, attn_logit_softcapping, final_logit_softcapping), as
    older or hand-made files do."""
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    extra = {}
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3") and "sliding_window" not in omit:
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        if "attn_logit_softcapping" not in omit:
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        if "final_logit_softcapping" not in omit:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(rotary)
        if rope.get("rope_type") == "longrope":
            original = config.original_max_position_embeddings
            factor = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(original)))
            writer.add_rope_scaling_orig_ctx_len(original)
            extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_factors(head_dim, rope)
    return extra


def write_gguf(path: Path, model, arch: str, type_name: str, tokenizer_model: Path | None, seed: int = 0,
               drop: tuple[str, ...] = (), omit: tuple[str, ...] = ()) -> Path:
    """Write `model` (a transformers Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3/Phi-3) as a GGUF file of `arch`.

    Matrices take ggml type `type_name`; norms and biases stay F32 (as llama.cpp keeps them).
    `tokenizer_model`: a sentencepiece file for the vocabulary, or None for a file without one.
    `drop`: GGUF tensor names left out (to make broken files). `omit`: Gemma metadata keys left out.
    """
    import gguf

    config = model.config
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' rope goes in the metadata
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.rope_theta))
    writer.add_vocab_size(config.vocab_size)
    extra_tensors = _family_metadata(writer, arch, config, rope, omit)
    if tokenizer_model is not None:
        pieces, scores, types = sentencepiece_vocab(tokenizer_model)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_chat_template(CHATML)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                   "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        layer_names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                            "post_feedforward_layernorm": "post_ffw_norm"})
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for key, tensor in state.items():
        weight = tensor.detach().float().numpy()
        if key in names:
            name = names[key]
        else:
            _, _, index, rest = key.split(".", 3)
            module, _, kind = rest.rpartition(".")
            name = f"blk.{index}.{layer_names[module]}.{kind}"
        if arch in ("llama", "mistral") and (".attn_q." in name or ".attn_k." in name):
            weight = _permute(weight, heads if ".attn_q." in name else kv_heads)
        if gemma and key.endswith("norm.weight"):  # llama.cpp stores what Gemma multiplies by: 1 + w
            weight = weight + np.float32(1.0)
        if name in drop:
            continue
        data, qtype = _encode(name, weight, type_name, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    for name, values in extra_tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def encoded_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, bytes] of `type_name`: gguf's own encoder where it has one, else valid random blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
    if type_name in K_QUANT_BLOCK:
        return random_k_quant_blocks(rows, cols, type_name, rng)
    if type_name == "IQ4_NL":
        return iq4_nl_blocks(values)
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:  # any bytes are a valid block; a small finite f16 scale first where it sits
        per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(rows, cols // per_block, nbytes), dtype=np.uint8)
        d = rng.uniform(1e-4, 1e-3, size=(rows, cols // per_block)).astype(np.float16)
        blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // per_block, 2)
        return blocks.reshape(rows, -1)


def iq4_nl_blocks(values: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of `values` (gguf has no encoder): d = max |v| / 127, each value's nearest d * kvalues[q]."""
    rows, cols = values.shape
    blocks = values.reshape(rows, cols // 32, 32)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16)
    levels = d.astype(np.float32)[..., None, None] * ggml_blocks.IQ4_VALUES.numpy().astype(np.float32)  # [.., 1, 16]
    q = np.abs(blocks[..., None] - levels).argmin(-1).astype(np.uint8)  # [rows, nb, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate((d.view(np.uint8).reshape(rows, -1, 2), packed), axis=-1).reshape(rows, -1)


def retyped(source, path, type_of, seed: int = 0):
    """`source` (a GGUF file) rewritten with each matrix in type_of(tensor name) (None: as it is)."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        type_name = type_of(tensor.name) if len(tensor.shape) == 2 else None
        if type_name is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = np.array(tensor.data, dtype=np.float32)  # [rows, cols] (an F32 source)
        blocks = encoded_blocks(type_name, *values.shape, rng) if type_name in K_QUANT_BLOCK else (
            iq4_nl_blocks(values) if type_name == "IQ4_NL" else gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name]))
        writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q4_k_m_type(name: str) -> str:
    """llama.cpp's Q4_K_M mix, roughly: Q6_K for v, down and the output, Q5_0 where rows fall back, Q4_K else."""
    if ".attn_v." in name or ".ffn_down." in name or name == "output.weight":
        return "Q6_K"
    if ".attn_output." in name:
        return "Q5_0"
    if name == "token_embd.weight":
        return "Q8_0"
    return "Q4_K"


GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3-longrope": "phi3", "llama3-rope": "llama"}


def family_gguf(folder: Path, name: str, tmp_path: Path, type_name: str, tokenizer_model: Path) -> tuple[Path, Path]:
    """(a Hugging Face folder, the GGUF file of `type_name` written from it) for the test checkpoint `name` (GGUF_ARCH).

    llama.cpp keeps no query_pre_attn_scalar, nor Gemma 3's layer pattern: Gemma's files scale attention
    by 1/sqrt(head_dim) (as every Gemma 2/3 but the 27B models does), and window five layers of six. The
    test checkpoint's other scalar is set back first (and saved again, the folder returned), and Gemma 3's
    is made again with 7 layers of the real pattern (layer 5 global).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import randomize_biases_and_norms

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if name == "gemma3":
        config = AutoConfig.from_pretrained(folder)
        config.num_hidden_layers, config.layer_types = 7, None
        config = type(config)(**{k: v for k, v in config.to_dict().items() if k != "layer_types"})
        torch.manual_seed(7)
        model = randomize_biases_and_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    if getattr(model.config, "query_pre_attn_scalar", None) is not None:
        model.config.query_pre_attn_scalar = model.config.head_dim
        folder = tmp_path / f"{name}-folder"
        model.save_pretrained(folder)
    return folder, write_gguf(tmp_path / f"{name}-{type_name}.gguf", model, GGUF_ARCH[name], type_name, tokenizer_model)
