"""Tokenizers: a checkpoint's tokenizer.json or a GGUF file's vocabulary (via `tokenizers`), or the demo byte tokenizer.

Both answer the same calls: encode, decode, raw_byte, bos/eos ids, vocab_size, apply_chat_template.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer

from runtime.chat_template import ChatTemplate
from runtime.gguf_tokenizer import TokenizerBuild, TokenizerBuildError
from runtime.model.config import UnsupportedModelError


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    """A Hugging Face fast tokenizer: a folder's tokenizer.json + tokenizer_config.json, or a GGUF file's metadata."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{model_dir} has no tokenizer.json")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self._setup(_RustTokenizer.from_file(str(path)), _token_text(config.get("bos_token")),
                    _token_text(config.get("eos_token")), template)

    @classmethod
    def from_gguf(cls, path: str | Path, checkpoint=None, build: TokenizerBuild | None = None) -> HFTokenizer:
        """The tokenizer and chat template a GGUF file's metadata holds, built by transformers' GGUF
        conversion (the same tokens transformers gives for that file), in a child process
        (runtime/gguf_tokenizer.py). `checkpoint`: the file, already open (a GGUFCheckpoint); `build`: its
        build, already started (start_gguf_build). GGUFError if the file has no tokenizer."""
        from runtime.model.gguf_file import GGUFError

        build = build or start_gguf_build(path, checkpoint)
        try:
            parts = build.parts()
        except TokenizerBuildError as exc:
            raise GGUFError(f"{path}: its tokenizer could not be built ({exc})") from exc
        tokenizer = cls.__new__(cls)
        tokenizer._setup(_RustTokenizer.from_str(parts.tokenizer_json), parts.bos_token, parts.eos_token,
                         parts.chat_template)
        return tokenizer

    def _setup(self, rust_tokenizer: _RustTokenizer, bos_token: str | None, eos_token: str | None,
               template: str | None) -> None:
        self._tokenizer = rust_tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = ChatTemplate(template, self.bos_token, self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL while it works (encode holds it: 0.5 s for 1 MB), and the fast
        # one skips the offsets nobody reads (half the time); the ids are encode's
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def tokenizer_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine indexes)."""
        return self._tokenizer.to_str()

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)[0]  # GIL released

    def token_piece(self, token_id: int) -> str:
        """The vocabulary's own string for one token ("▁and", "<0xE6>"), as transformers' convert_ids_to_tokens."""
        return self._tokenizer.id_to_token(token_id) or ""

    def raw_byte(self, token_id: int) -> int | None:
        """The byte a byte-fallback token ("<0xE6>") stands for; None for any other token."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return int(piece[3:5], 16)
            except ValueError:
                return None
        return None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Token ids of the chat prompt; a real template carries its own special tokens.

        `template_kwargs`: more variables for the template (vLLM's chat_template_kwargs, e.g. Qwen3's
        enable_thinking)."""
        text = self.chat_template.render(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=self.chat_template.is_fallback)


class ByteTokenizer:
    """The demo tokenizer: ids 0..255 are bytes, 256 is <bos>, 257 is <eos>."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    bos_token = "<bos>"
    eos_token = "<eos>"

    def __init__(self) -> None:
        self.chat_template = ChatTemplate(None, self.bos_token, self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def token_piece(self, token_id: int) -> str:
        """"<0xE6>" for a byte, the special token's name otherwise."""
        if token_id < 256:
            return f"<0x{token_id:02X}>"
        return self.bos_token if token_id == self.bos_token_id else self.eos_token

    def raw_byte(self, token_id: int) -> int | None:
        """Ids 0..255 are bytes; None for <bos> and <eos>."""
        return token_id if token_id < 256 else None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        text = []
        for token_id in token_ids:
            if token_id < 256:
                data.append(token_id)
                continue
            if not skip_special_tokens:
                text.append(data.decode("utf-8", errors="replace"))
                data.clear()
                text.append(self.bos_token if token_id == self.bos_token_id else self.eos_token)
        text.append(data.decode("utf-8", errors="replace"))
        return "".join(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        return self.encode(self.chat_template.render(messages, add_generation_prompt, tools, template_kwargs),
                           add_special_tokens=True)


def start_gguf_build(path: str | Path, checkpoint=None) -> TokenizerBuild:
    """A GGUF file's tokenizer build, started (HFTokenizer.from_gguf takes it when the weights are in).
    GGUFError now if the file's metadata holds no tokenizer. `checkpoint`: the file, already open."""
    from runtime.model.gguf_file import GGUFCheckpoint, GGUFError

    checkpoint = checkpoint or GGUFCheckpoint(path)
    missing = [key for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if not checkpoint.has_field(key)]
    if missing:
        raise GGUFError(f"{path}: the file's metadata holds no tokenizer ({', '.join(missing)} missing)")
    return TokenizerBuild(path, checkpoint.metadata_bytes)


def load_tokenizer(model: str | Path) -> HFTokenizer | ByteTokenizer:
    """The tokenizer of a checkpoint folder or GGUF file, or the byte tokenizer for "demo" (what
    Engine.from_pretrained uses)."""
    if str(model) == "demo":
        return ByteTokenizer()
    if str(model).lower().endswith(".gguf"):
        return HFTokenizer.from_gguf(model)
    return HFTokenizer(model)
