"""A Hugging Face tokenizer folder rebuilt from one of llama.cpp's vocab-only GGUF files.

The machine reaches no model hub, but llama.cpp's sources (bench/.llama-cpp, fetched for the
llama-server peer) ship the real vocabularies of Qwen2, Llama 3 and others as
`models/ggml-vocab-*.gguf`: tokens, merges, token types and the chat template. A byte-level
BPE built from them has the real vocabulary (what grammar engines index) and the real chat
template (what tool calling renders), which a 512-token test vocabulary lacks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common import REPO, log

LLAMA_CPP = REPO / "bench" / ".llama-cpp"
CONTROL = 3  # llama.cpp's token type for special tokens


def vocab_gguf(name: str) -> Path:
    """Path of llama.cpp's `ggml-vocab-<name>.gguf` (raises FileNotFoundError if the sources are not fetched)."""
    found = sorted(LLAMA_CPP.glob(f"*/vendor/llama.cpp/models/ggml-vocab-{name}.gguf"))
    if not found:
        raise FileNotFoundError(f"no ggml-vocab-{name}.gguf under {LLAMA_CPP} (bench_serving.py fetches llama.cpp)")
    return found[0]


def build_tokenizer_dir(name: str, out: Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json for vocab `name` into `out` (once)."""
    if (out / "tokenizer.json").is_file():
        return out
    gguf_py = next(vocab_gguf(name).parents[1].glob("gguf-py"))
    sys.path.insert(0, str(gguf_py))
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = gguf.GGUFReader(str(vocab_gguf(name)))

    def field(key):
        f = reader.fields[key]
        return [f.contents(i) for i in range(len(f.data))] if len(f.data) > 1 else f.contents()

    tokens, types, merges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"), field("tokenizer.ggml.merges")
    eos = tokens[field("tokenizer.ggml.eos_token_id")]
    log(f"{name}: {len(tokens)} tokens, {len(merges)} merges, eos {eos!r}")
    vocab = {t: i for i, t in enumerate(tokens)}  # special tokens too: added below, they keep these ids
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [(i, t) for i, t in enumerate(tokens) if types[i] == CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    for i, t in specials:
        if tokenizer.token_to_id(t) != i:
            raise ValueError(f"special token {t!r} landed at {tokenizer.token_to_id(t)}, not {i}")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"eos_token": eos, "bos_token": None, "chat_template": field("tokenizer.chat_template")}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def qwen2_tokenizer_dir() -> Path:
    """Qwen2's tokenizer (151,936 tokens), built once into bench/.models/ (git-ignored)."""
    return build_tokenizer_dir("qwen2", REPO / "bench" / ".models" / "qwen2-tokenizer")


if __name__ == "__main__":
    print(build_tokenizer_dir(sys.argv[1], Path(sys.argv[2])))
