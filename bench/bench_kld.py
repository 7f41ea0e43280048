"""Fidelity as llama.cpp's quality tables measure it: the KL divergence of each token's distribution from the
float32 model's, ours against llama.cpp's own on the same files.

    .venv/bin/python bench/bench_kld.py [--types Q4_0 Q4_K_M ...] [--quick]

Files: SmolLM2-135M-Instruct converted to F32 by llama.cpp's converter and quantized by its
llama-quantize (bench/gguf_files.py). Text: tests/data/english_text.txt, tokenized by llama.cpp
(llama-tokenize; ours must give the same ids, and the result says whether it did).

llama.cpp: `llama-perplexity -c 512 --kl-divergence-base` on the F32 file, then `--kl-divergence`
on each quantized file; its "Mean KLD" line. Ours, the same method: chunks of 512 tokens, each
starting with BOS; the second half of each chunk scored (rows 256..510, each predicting the next
token); KLD(p_f32 || p_file) per row, averaged. Our float32 reference is the F32 file served
dense in float32; each quantized file is served as `pagedserve serve` would (quantization auto,
the server's default dtype, `engine.dtype`: float32). Results: bench/results/kld.json.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from common import REPO, log, machine_info, write_result

from gguf_files import gguf_path, llama_cpp_tools

TEXT = REPO / "tests" / "data" / "english_text.txt"
TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
CONTEXT = 512


def llama_cpp_ids(model: Path) -> list[int]:
    out = subprocess.run([str(llama_cpp_tools() / "llama-tokenize"), "-m", str(model), "-f", str(TEXT), "--ids",
                          "--log-disable", "--no-bos"], check=True, capture_output=True, text=True).stdout
    return [int(t) for t in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def llama_cpp_kld(model: Path, base: Path, make_base: bool) -> float | None:
    argv = [str(llama_cpp_tools() / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(CONTEXT),
            "-t", "2", "--kl-divergence-base", str(base)]
    if not make_base:
        argv.append("--kl-divergence")
    out = subprocess.run(argv, check=True, capture_output=True, text=True)
    match = re.search(r"Mean\s+KLD:\s+([0-9.eE+-]+)", out.stdout + out.stderr)
    return float(match.group(1)) if match else None


def our_logprobs(path: Path, ids: list[int], quantization: str, dtype: str):
    """Per chunk, log-softmax of rows 256..510: float32 [chunks * 255, vocab]."""
    import torch

    from runtime import Engine
    from runtime.perplexity import prefill_hidden

    engine = Engine.from_pretrained(path, quantization=quantization, dtype=dtype, num_blocks=CONTEXT // 16 + 1,
                                    block_size=16)
    bos = engine.tokenizer.bos_token_id
    rows = []
    with torch.inference_mode():
        for start in range(0, len(ids) - CONTEXT + 1, CONTEXT):
            chunk = torch.tensor([bos] + ids[start + 1 : start + CONTEXT], dtype=torch.int64)
            hidden = prefill_hidden(engine, chunk, 0, CONTEXT)  # [CONTEXT, hidden]; a fresh sequence each chunk
            logits = engine.runner.model.compute_logits(hidden[CONTEXT // 2 : CONTEXT - 1])  # [255, vocab]
            rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows), engine.tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from config.settings import EngineSettings

    served_dtype = EngineSettings().dtype  # what `pagedserve serve` runs a file in unless told otherwise
    f32 = gguf_path("smollm2-F32")
    ids = llama_cpp_ids(f32)
    base, tokenizer = our_logprobs(f32, ids, "none", "float32")
    ours_ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    result = {"machine": machine_info(), "tokens": len(ids), "scored_rows": base.shape[0],
              "token_ids_equal_llama_cpp": ours_ids == ids, "types": {}}
    log(f"text: {len(ids)} tokens (ours equal to llama.cpp's: {ours_ids == ids}), {base.shape[0]} rows scored")
    with tempfile.TemporaryDirectory(prefix="kld-") as tmp:
        base_file = Path(tmp) / "f32.kld"
        llama_cpp_kld(f32, base_file, make_base=True)
        for type_name in args.types:
            path = gguf_path(f"smollm2-{type_name}")
            theirs = llama_cpp_kld(path, base_file, make_base=False)
            logprobs, _ = our_logprobs(path, ids, "auto", served_dtype)
            ours = float((base.exp() * (base - logprobs)).sum(-1).mean())
            result["types"][type_name] = {"ours": ours, "llama.cpp": theirs,
                                          "ratio": ours / theirs if theirs else None}
            log(f"{type_name}: KLD ours {ours:.5f}, llama.cpp {theirs}, ratio "
                f"{ours / theirs if theirs else float('nan'):.3f}")
            write_result("kld", args.quick, result)


if __name__ == "__main__":
    main()
