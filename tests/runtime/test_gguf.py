"""GGUF files: dequantization bit for bit with llama.cpp's reader, greedy tokens equal to transformers
on the same file (every architecture and tensor type), the tokenizer from the metadata, and bad files."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from runtime import Engine, SamplingParams
from runtime.model import ggml_blocks
from runtime.model.gguf_file import GGUFCheckpoint, GGUFError
from tests.conftest import REPO, randomize_biases_and_norms
from tests.gguf_files import random_k_quant_blocks, write_gguf

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
ARCHS = ("llama", "mistral", "qwen2")  # checkpoints; llama.cpp writes Mistral's as architecture "llama"
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 45, 300, 22, 99, 7], [1] + list(range(60, 101))]


def _encoded(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    import gguf

    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    if type_name.endswith("_K"):
        return random_k_quant_blocks(rows, cols, type_name, rng)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_matches_llama_cpp_reader_bit_for_bit(type_name):
    import gguf

    rng = np.random.default_rng(3)
    qtype = gguf.GGMLQuantizationType[type_name]
    for rows, cols in ((1, 256), (7, 512), (33, 768)):
        raw = _encoded(type_name, rows, cols, rng)
        ours = ggml_blocks.dequantize(raw, int(qtype), (rows, cols))
        ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
        assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
        assert torch.equal(ours.view(torch.int32), ref.reshape(rows, cols).view(torch.int32))


def _hf_model(arch: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1,
                  eos_token_id=2, rms_norm_eps=1e-5)
    config = {"llama": LlamaConfig(**common, tie_word_embeddings=False),
              "mistral": MistralConfig(**common, tie_word_embeddings=False),
              "qwen2": Qwen2Config(**common, tie_word_embeddings=True)}[arch]
    torch.manual_seed(ARCHS.index(arch))
    return randomize_biases_and_norms(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


@pytest.fixture(scope="module")
def hf_models():
    return {arch: _hf_model(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _transformers_greedy(path, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_dequantized_gguf_matches_transformers(hf_models, gguf_dir, stories_dir, arch, type_name):
    path = write_gguf(gguf_dir / f"{arch}-{type_name}.gguf", hf_models[arch], GGUF_ARCH[arch], type_name,
                      stories_dir / "tokenizer.model", seed=TYPES.index(type_name))
    engine = Engine.from_pretrained(path, quantization="none", num_blocks=64, block_size=8)
    ours = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert ours == _transformers_greedy(path, PROMPTS, GREEDY.max_tokens)


def test_tokenizer_and_chat_template_come_from_the_metadata(hf_models, gguf_dir, stories_dir):
    from transformers import AutoTokenizer

    path = write_gguf(gguf_dir / "tok.gguf", hf_models["llama"], "llama", "F16", stories_dir / "tokenizer.model")
    engine = Engine.from_pretrained(path, num_blocks=16)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("Once upon a time, there was a little girl.", "  two  spaces\nand a newline", "émigré 東京 🙂"):
        assert engine.tokenizer.encode(text) == reference(text).input_ids
        assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == reference.decode(
            reference(text).input_ids, skip_special_tokens=True)
    messages = [{"role": "user", "content": "Hi there"}]
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected.startswith("<|im_start|>user\nHi there<|im_end|>\n")
    assert engine.tokenizer.apply_chat_template(messages) == reference(expected, add_special_tokens=False).input_ids
    assert engine.model_name == "tok"


# --- bad files: one error naming the file and the problem ---------------------------------

def _bad_file(kind, hf_models, gguf_dir, stories_dir):
    import gguf

    model = hf_models["llama"]
    if kind == "truncated":
        good = write_gguf(gguf_dir / "whole.gguf", model, "llama", "Q8_0", stories_dir / "tokenizer.model")
        path = gguf_dir / "truncated.gguf"
        path.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
        return path, "cut short"
    if kind == "not-gguf":
        path = gguf_dir / "text.gguf"
        path.write_text("this is not a model\n" * 100)
        return path, "not a readable GGUF file"
    if kind == "architecture":
        return write_gguf(gguf_dir / "falcon.gguf", model, "falcon", "F16", stories_dir / "tokenizer.model"), \
            "architecture 'falcon' is not supported"
    if kind == "tensor-type":
        path = write_gguf(gguf_dir / "q8_1.gguf", model, "llama", "F16", stories_dir / "tokenizer.model",
                          drop=("blk.0.ffn_up.weight",))
        # the same file with one tensor in Q8_1 (llama.cpp's activation type, never a weight's): not read here
        writer_path = gguf_dir / "q8_1-typed.gguf"
        reader = gguf.GGUFReader(str(path))
        writer = gguf.GGUFWriter(str(writer_path), "llama")
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            value = field.contents()
            writer.add_key_value(field.name, value, field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
        for tensor in reader.tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
        rows, cols = model.model.layers[0].mlp.up_proj.weight.shape
        blocks = np.random.default_rng(0).integers(0, 256, size=(rows, cols // 32 * 40), dtype=np.uint8)
        writer.add_tensor("blk.0.ffn_up.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return writer_path, "type Q8_1, which this runtime does not read"
    if kind == "no-tokenizer":
        return write_gguf(gguf_dir / "notok.gguf", model, "llama", "F16", None), "holds no tokenizer"
    if kind == "missing-tensor":
        return write_gguf(gguf_dir / "missing.gguf", model, "llama", "F16", stories_dir / "tokenizer.model",
                          drop=("blk.1.ffn_down.weight",)), "tensors missing from the file"
    raise ValueError(kind)


BAD_KINDS = ("truncated", "not-gguf", "architecture", "tensor-type", "no-tokenizer", "missing-tensor")


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_file_is_one_error_naming_the_file(hf_models, gguf_dir, stories_dir, kind):
    path, problem = _bad_file(kind, hf_models, gguf_dir, stories_dir)
    with pytest.raises(GGUFError) as error:
        Engine.from_pretrained(path, num_blocks=16)
    assert str(path) in str(error.value) and problem in str(error.value)


@pytest.mark.parametrize("kind", ("truncated", "tensor-type", "no-tokenizer"))
def test_bad_file_on_the_command_line_is_one_line_not_a_traceback(hf_models, gguf_dir, stories_dir, kind):
    path, problem = _bad_file(kind, hf_models, gguf_dir, stories_dir)
    result = subprocess.run([sys.executable, "-m", "service.cli", "generate", "--model", str(path), "hi"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and problem in errors[0]
    assert "Traceback" not in result.stderr


def test_q_and_k_rows_are_put_back_in_hugging_face_order(hf_models, gguf_dir, stories_dir):
    model = hf_models["llama"]
    path = write_gguf(gguf_dir / "perm.gguf", model, "llama", "F32", stories_dir / "tokenizer.model")
    tensors = {t.name: t.dequantize() for t in GGUFCheckpoint(path).tensors()}
    for name in ("q_proj", "k_proj"):
        key = f"model.layers.1.self_attn.{name}.weight"
        assert torch.equal(tensors[key], model.state_dict()[key])
