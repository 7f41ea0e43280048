"""GGUF files the tests write themselves: a Hugging Face model's weights, encoded as llama.cpp does.

`write_gguf` lays a transformers model out the way llama.cpp's converter would: its tensor
names, q/k rows permuted for Llama-family rope, each matrix in the asked ggml type
(gguf.quants encodes F16, BF16, Q8_0, Q4_0 and Q4_1; for the K-quants, which gguf cannot
encode, random blocks with small finite scales stand in: any bytes are a valid K-quant), and
stories260K's sentencepiece vocabulary with a ChatML template. Reading the file back is the
job of the code under test and of transformers (the reference).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

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


def write_gguf(path: Path, model, arch: str, type_name: str, tokenizer_model: Path | None, seed: int = 0,
               drop: tuple[str, ...] = ()) -> Path:
    """Write `model` (a transformers Llama/Mistral/Qwen2) as a GGUF file of architecture `arch`.

    Matrices take ggml type `type_name`; norms and biases stay F32 (as llama.cpp keeps them).
    `tokenizer_model`: a sentencepiece file for the vocabulary, or None for a file without one.
    `drop`: GGUF tensor names left out (to make broken files).
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
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
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
                   "mlp.down_proj": "ffn_down"}
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
        if name in drop:
            continue
        data, qtype = _encode(name, weight, type_name, rng)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
