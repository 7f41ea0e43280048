"""A GGUF file (llama.cpp's format) as this runtime reads it: architecture, tokenizer, tensors.

The file is mapped into memory and its header read by runtime/model/gguf_header.py (its arrays,
the tokenizer's vocabulary and merges, stay bytes in the map): nothing is read until a tensor is
asked for, and tensors are handed out one at a time under their Hugging Face names, so a loader never holds more than one of them
unpacked. Every problem (not a GGUF file, cut short, an architecture or tensor type this
runtime does not run) is a GGUFError naming the file.

llama.cpp's converter reorders the rows of q and k in Llama-family files (each head's rotary
pairs interleaved, for its rope kernel); `tensors()` puts them back in Hugging Face's order.
A row holds whole quantization blocks, so this works on the raw blocks, quantized or not.

Families (runtime/model/config.py's table) as llama.cpp writes them: Qwen3's attn_q_norm and
attn_k_norm; Gemma 2/3's post_attention_norm and post_ffw_norm, its norms stored as 1 + w
(which is what the model multiplies by), and what llama.cpp leaves to code rather than
metadata (every other layer windowed in Gemma 2, five of six in Gemma 3, whose windowed
layers rotate with base 10,000; the attention scale 1/sqrt(head_dim), but 1/sqrt(hidden /
heads) for the 27B models); Phi-3's fused attn_qkv and ffn_up (gate rows, then up), and its
LongRoPE factors as tensors; Llama 3.1's scaled rope as rope_freqs (each pair's divisor).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.model import ggml_blocks
from runtime.model.config import ModelConfig, UnsupportedModelError, model_config_from_hf
from runtime.model.gguf_header import GGUFHeader, TensorInfo

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")  # Mistral's files are "llama"
PERMUTED_ARCHITECTURES = ("llama",)  # q/k rows reordered by llama.cpp's converter
MODEL_TYPES = {"gemma3": "gemma3_text"}  # architecture -> the config's model_type, where they differ
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales these models' attention by hidden / heads
# what llama.cpp assumes where a Gemma 2 file has no such key (src/models/gemma2.cpp, llama-hparams.h)
GEMMA2_DEFAULTS = {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = {  # Gemma's four norms, by their Hugging Face names (runtime/model/loader.py maps them)
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFError(UnsupportedModelError):
    """A GGUF file this runtime cannot run; the message names the file and the problem."""


def is_gguf_path(model: str | Path) -> bool:
    """Whether `model` names a GGUF file (by its suffix; the file need not exist)."""
    return str(model).lower().endswith(".gguf")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file, under its Hugging Face name, still encoded as the file has it."""

    name: str  # Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
    gguf_name: str  # the file's name, e.g. "blk.0.attn_q.weight"
    qtype: int  # ggml type id (runtime/model/ggml_blocks.py)
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a matrix
    raw: np.ndarray  # the encoded data (a view of the memory map, rows already in Hugging Face's order)

    @property
    def type_name(self) -> str:
        return ggml_blocks.type_name(self.qtype)

    def dequantize(self) -> torch.Tensor:  # float32 `shape`
        return ggml_blocks.dequantize(self.raw, self.qtype, self.shape)


def _inverse_rope_permutation(rows: int, num_heads: int) -> np.ndarray:  # int64 [rows]
    """Row order that undoes llama.cpp's q/k permutation: hf_rows = gguf_rows[order].

    The converter writes gguf = hf.reshape(heads, 2, half, ...).swapaxes(1, 2): row
    (h, i, j) of the file (i < half, j < 2) is Hugging Face's row (h, j, i).
    """
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(rows)  # [hf row] -> file row


class GGUFCheckpoint:
    """An open GGUF file: its metadata, model config and tensors (read lazily from the memory map)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        try:
            self._header = GGUFHeader(self.path)
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                            "the file may be cut short or not a GGUF file at all") from exc
        self.architecture = self.field("general.architecture", None)
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.architecture!r} is not supported "
                            f"(supported: {', '.join(ARCHITECTURES)})")
        self._tensors: dict[str, TensorInfo] = {t.name: t for t in self._header.tensors}
        self._check_tensor_data()

    def _check_tensor_data(self) -> None:
        """Every tensor's bytes lie inside the file (a cut-short file fails here, not mid-load)."""
        size = self._header.size
        for tensor in self._header.tensors:
            end = tensor.data_offset + tensor.n_bytes
            if end > size:
                raise GGUFError(f"{self.path}: cut short: tensor {tensor.name} ends at byte {end}, "
                                f"past the file's {size} bytes")
            if tensor.qtype not in ggml_blocks.SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {tensor.name} has type {ggml_blocks.type_name(tensor.qtype)}, "
                                f"which this runtime does not read (supported: "
                                f"{', '.join(ggml_blocks.TYPE_NAMES.values())})")

    _MISSING = object()

    def field(self, key: str, default=_MISSING):
        """A metadata value (str, number, or list), or `default` if the file lacks it."""
        if not self._header.has(key):
            if default is self._MISSING:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        try:
            return self._header.value(key)
        except (ValueError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{self.path}: metadata key {key!r} cannot be read ({exc})") from exc

    @property
    def metadata_bytes(self) -> int:
        """Bytes before the tensor data: the header (magic, metadata, tensor infos, padding)."""
        return self._header.data_start

    def has_field(self, key: str) -> bool:
        return self._header.has(key)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    @property
    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each ggml type the file holds, by type name."""
        counts: dict[str, int] = {}
        for tensor in self._header.tensors:
            name = ggml_blocks.type_name(tensor.qtype)
            counts[name] = counts.get(name, 0) + 1
        return counts

    def hf_config(self) -> dict:
        """The model's Hugging Face config.json fields, from the file's metadata."""
        arch = self.architecture
        key = lambda name, default=self._MISSING: self.field(f"{arch}.{name}", default)  # noqa: E731
        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens", None)
        vocab = key("vocab_size", None) or (len(tokens) if tokens else None)
        if vocab is None:
            embed = self._tensors.get("token_embd.weight")
            if embed is None:
                raise GGUFError(f"{self.path}: no token_embd.weight tensor")
            vocab = int(embed.dims[1])
        rope_scaling = self._rope_scaling(key)
        eos = self.field("tokenizer.ggml.eos_token_id", None)
        num_layers = int(key("block_count"))
        head_dim = int(key("attention.key_length", hidden // num_heads))
        config = {
            "model_type": MODEL_TYPES.get(arch, arch),
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "max_position_embeddings": int(key("context_length", 2048)),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "rope_scaling": rope_scaling or None,
            "tie_word_embeddings": not self.has_tensor("output.weight"),
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": eos,
        }
        rotary_dim = key("rope.dimension_count", None)
        if rotary_dim is not None and int(rotary_dim) != head_dim:
            config["rotary_dim"] = int(rotary_dim)
        if arch == "qwen2":
            config["use_sliding_window"] = False
        elif arch == "llama":
            config["attention_bias"] = self.has_tensor("blk.0.attn_q.bias")
        elif arch in GEMMA_27B_LAYERS:
            config["hidden_activation"] = "gelu_pytorch_tanh"
            # where a file leaves these out, llama.cpp's rules: Gemma 2 windows 4,096 positions and caps scores
            # at 50 and logits at 30 (its published values); a Gemma 3 file without a window windows no layer
            window = key("attention.sliding_window", GEMMA2_DEFAULTS["sliding_window"] if arch == "gemma2" else 0)
            config["sliding_window"] = int(window) if window else None
            config["query_pre_attn_scalar"] = (hidden // num_heads if num_layers == GEMMA_27B_LAYERS[arch]
                                               else head_dim)
            if arch == "gemma2":
                for name in ("attn_logit_softcapping", "final_logit_softcapping"):
                    config[name] = float(key(name, GEMMA2_DEFAULTS[name]))
            else:
                cap = key("final_logit_softcapping", 0.0)  # 0 or absent: none (llama.cpp's rule)
                config["final_logit_softcapping"] = float(cap) if cap else None
                pattern = key("attention.sliding_window_pattern", 6)  # a period, or (newer files) a flag per layer
                if isinstance(pattern, list):
                    config["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
                else:
                    config["sliding_window_pattern"] = int(pattern)
                config["rope_local_base_freq"] = float(key("rope.freq_base_swa", 10000.0))
        elif arch == "phi3":
            window = key("attention.sliding_window", None)
            config["sliding_window"] = int(window) if window else None
        return config

    def _small_tensor(self, name: str) -> list[float]:
        """A small float tensor's values (rope factors), as llama.cpp stores them."""
        tensor = self._tensors[name]
        if tensor.qtype != ggml_blocks.F32:
            raise GGUFError(f"{self.path}: tensor {name} is {ggml_blocks.type_name(tensor.qtype)}, expected F32")
        return [float(v) for v in np.asarray(self._header.data(tensor), dtype=np.float32).reshape(-1)]

    def _rope_scaling(self, key) -> dict:
        """The rope scaling in ModelConfig's terms, from the metadata and the factor tensors llama.cpp writes."""
        scaling_type = key("rope.scaling.type", None)
        if self.has_tensor("rope_factors_long.weight"):  # Phi-3's LongRoPE
            return {"rope_type": "longrope", "short_factor": self._small_tensor("rope_factors_short.weight"),
                    "long_factor": self._small_tensor("rope_factors_long.weight"),
                    "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                    "attention_factor": float(key("rope.scaling.attn_factor", 1.0))}
        if self.has_tensor("rope_freqs.weight"):  # Llama 3.1's scaled rope, as each pair's divisor
            if scaling_type not in (None, "none"):
                raise GGUFError(f"{self.path}: rope_freqs together with rope scaling {scaling_type!r}")
            return {"rope_type": "freq_factors", "factors": self._small_tensor("rope_freqs.weight")}
        if scaling_type == "linear":
            return {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        if scaling_type not in (None, "none"):
            raise GGUFError(f"{self.path}: rope scaling {scaling_type!r} is not supported (none, linear, "
                            "rope_freqs or Phi-3's long/short factors)")
        return {}

    def model_config(self) -> ModelConfig:
        """The runtime's ModelConfig for this file (GGUFError if the metadata is incomplete or unsupported)."""
        try:
            return model_config_from_hf(self.hf_config())
        except GGUFError:
            raise
        except (UnsupportedModelError, KeyError, TypeError, ValueError) as exc:
            raise GGUFError(f"{self.path}: {exc}") from exc

    def _hf_name(self, gguf_name: str) -> str | None:
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        match = _LAYER_TENSOR.match(gguf_name)
        if not match:
            return None
        kind = match.group(2)
        if self.architecture in GEMMA_27B_LAYERS and kind in _GEMMA_LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_GEMMA_LAYER_NAMES[kind]}.{match.group(3)}"
        if self.architecture == "phi3" and kind == "ffn_up":  # gate and up rows in one tensor
            return f"model.layers.{match.group(1)}.mlp.gate_up_proj.{match.group(3)}"
        if kind in _LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_LAYER_NAMES[kind]}.{match.group(3)}"
        return None

    def tensors(self) -> Iterator[GGUFTensor]:
        """Each tensor the model uses, under its Hugging Face name, q/k rows in Hugging Face's order."""
        config = self.hf_config()
        for tensor in self._header.tensors:
            name = self._hf_name(tensor.name)
            if name is None:
                continue
            shape = tuple(reversed(tensor.dims))  # ggml lists the fastest dimension first
            raw = self._header.data(tensor)
            if self.architecture in PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "k_proj.weight",
                                                                              "q_proj.bias", "k_proj.bias")):
                heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
                raw = np.asarray(raw).reshape(shape[0], -1)[_inverse_rope_permutation(shape[0], heads)]
            yield GGUFTensor(name, tensor.name, tensor.qtype, shape, raw)

    def close(self) -> None:
        """Drop the memory map (tensors handed out keep their own reference to it)."""
        self._header = None
        self._tensors = {}
