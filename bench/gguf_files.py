"""The GGUF files CPU users run, made here with llama.cpp's own tools: SmolLM2 in several quant types, and
random-weight models of today's small families at their real shapes, in Q4_K_M.

    .venv/bin/python bench/gguf_files.py NAME...        # prints each file's path (made on first use)

Names: smollm2-{F32,Q4_0,Q4_1,Q4_K_M,Q5_K_M,Q6_K,Q8_0} (SmolLM2-135M-Instruct, the float32 folder of
bench/smollm2.py converted by llama.cpp's convert_hf_to_gguf.py, then llama-quantize), and
{qwen3-0.6b,llama3.2-1b,gemma3-1b}-Q4_K_M: transformers config classes at the published shapes,
random weights (speed does not depend on their values), stories260K's tokenizer (the converter
pads the vocabulary to the model's). Files live in bench/.models/gguf (git-ignored); each is
written aside and renamed, so a cut-short run never leaves a half file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from common import REPO, log

MODELS = REPO / "bench" / ".models" / "gguf"
STORIES = REPO.parent / "shared" / "models" / "stories260K"
SMOLLM2_TYPES = ("F32", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity", "llama-tokenize")

# published shapes (config.json of each model), random weights
SHAPES = {
    "qwen3-0.6b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    "llama3.2-1b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "gemma3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=512, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
}


def llama_cpp_tools() -> Path:
    """The folder of llama.cpp's binaries (bench/peers/llama_cpp.sh builds llama-server; the others here)."""
    server = Path(subprocess.run(["bash", str(REPO / "bench" / "peers" / "llama_cpp.sh")], check=True,
                                 capture_output=True, text=True, env=os.environ | {"PYTHON": sys.executable}
                                 ).stdout.strip().splitlines()[-1])
    build = server.parents[1]
    missing = [tool for tool in TOOLS if not (build / "bin" / tool).is_file()]
    if missing:
        log(f"llama.cpp: building {', '.join(missing)}")
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *missing],
                       check=True, stdout=subprocess.DEVNULL)
    return build / "bin"


def _convert(folder: Path, out: Path, outtype: str) -> Path:
    """`folder` as a GGUF by llama.cpp's converter (the source that ships with the tools being run)."""
    source = llama_cpp_tools().parents[1]
    partial = out.with_suffix(".part")
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                    "--outfile", str(partial)], check=True, stdout=subprocess.DEVNULL,
                   env=os.environ | {"PYTHONPATH": str(source / "gguf-py"), "HF_HUB_OFFLINE": "1"})
    partial.rename(out)
    return out


def _quantize(source: Path, out: Path, type_name: str) -> Path:
    partial = out.with_suffix(".part")
    subprocess.run([str(llama_cpp_tools() / "llama-quantize"), str(source), str(partial), type_name], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial.rename(out)
    return out


def _random_folder(name: str) -> Path:
    """A random-weight checkpoint at `name`'s shape (bfloat16 safetensors) with stories260K's tokenizer."""
    folder = MODELS / f"{name}-hf"
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    class_name, fields = SHAPES[name]
    config = getattr(transformers, class_name)(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    log(f"{name}: random weights at the published shape")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = folder.with_suffix(".part")
    model.save_pretrained(partial)
    for file in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / file, partial / file)
    partial.rename(folder)
    return folder


def gguf_path(name: str) -> Path:
    """The file `name` (see the module doc), made on first use."""
    out = MODELS / f"{name}.gguf"
    if out.is_file():
        return out
    MODELS.mkdir(parents=True, exist_ok=True)
    family, _, type_name = name.rpartition("-")
    if family == "smollm2":
        from smollm2 import smollm2_dir

        if type_name == "F32":
            log("smollm2: converting the float32 folder")
            return _convert(smollm2_dir(), out, "f32")
        log(f"smollm2: quantizing to {type_name}")
        return _quantize(gguf_path("smollm2-F32"), out, type_name)
    if family not in SHAPES:
        raise SystemExit(f"unknown file {name!r}: smollm2-{{{','.join(SMOLLM2_TYPES)}}} or "
                         f"{{{','.join(SHAPES)}}}-Q4_K_M")
    f16 = MODELS / f"{family}-F16.gguf"
    if not f16.is_file():
        log(f"{family}: converting to F16")
        _convert(_random_folder(family), f16, "f16")
    log(f"{family}: quantizing to {type_name}")
    return _quantize(f16, out, type_name)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(gguf_path(arg))
