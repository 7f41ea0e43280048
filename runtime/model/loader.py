"""Load a checkpoint folder's safetensors weights into LlamaForCausalLM (every supported family).

Hugging Face keeps q/k/v and gate/up as separate matrices (Phi-3 already fuses them); we
stack them into one matrix each (one matmul instead of three or two), so each source tensor
is copied into its rows. Sharded checkpoints (model.safetensors.index.json) are read shard by
shard. Gemma's norms scale by (1 + w): the offset is added as each norm weight is copied, in
float32, once. A multimodal Gemma 3 folder's text model is read; its vision tower is not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from tqdm import tqdm

from runtime.model.config import ModelConfig, UnsupportedModelError
from runtime.model.llama import LlamaForCausalLM

log = structlog.get_logger(__name__)

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))  # a multimodal Gemma 3 folder's text model


def _text_key(key: str) -> str:
    for prefix, replacement in _TEXT_MODEL_PREFIXES:
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return key


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no *.safetensors weights")
    return files


def weight_target(model: LlamaForCausalLM, key: str) -> tuple[torch.Tensor, slice] | None:
    """The parameter and row range a checkpoint tensor fills, or None if we do not use it."""
    config = model.config
    key = _text_key(key)
    if key == "model.embed_tokens.weight":
        return model.embed_tokens, slice(None)
    if key == "model.norm.weight":
        return model.norm.weight, slice(None)
    if key == "lm_head.weight":
        return (None if config.tie_word_embeddings else (model.lm_head, slice(None)))
    match = _LAYER_KEY.match(key)
    if not match:
        return None
    layer_idx, name = int(match.group(1)), match.group(2)
    if layer_idx >= config.num_layers:
        return None
    layer = model.layers[layer_idx]
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = attn.q_size, attn.kv_size
    inter = mlp.intermediate_size
    stacked = {
        "self_attn.q_proj": ("qkv", slice(0, q)),
        "self_attn.k_proj": ("qkv", slice(q, q + kv)),
        "self_attn.v_proj": ("qkv", slice(q + kv, q + 2 * kv)),
        "self_attn.qkv_proj": ("qkv", slice(0, q + 2 * kv)),  # Phi-3: fused already
        "mlp.gate_proj": ("gate_up", slice(0, inter)),
        "mlp.up_proj": ("gate_up", slice(inter, 2 * inter)),
        "mlp.gate_up_proj": ("gate_up", slice(0, 2 * inter)),  # Phi-3: gate rows, then up
    }
    plain = {
        "self_attn.o_proj.weight": attn.o_weight,
        "self_attn.o_proj.bias": attn.o_bias,
        "mlp.down_proj.weight": mlp.down_weight,
        "mlp.down_proj.bias": mlp.down_bias,
        "input_layernorm.weight": layer.input_layernorm.weight,
    }
    if attn.q_norm is not None:
        plain["self_attn.q_norm.weight"] = attn.q_norm.weight
        plain["self_attn.k_norm.weight"] = attn.k_norm.weight
    if layer.attn_output_norm is not None:  # Gemma's names for its four norms
        plain["post_attention_layernorm.weight"] = layer.attn_output_norm.weight
        plain["pre_feedforward_layernorm.weight"] = layer.post_attention_layernorm.weight
        plain["post_feedforward_layernorm.weight"] = layer.mlp_output_norm.weight
    else:
        plain["post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    if name in plain:
        return None if plain[name] is None else (plain[name], slice(None))
    module, _, kind = name.rpartition(".")
    if module in stacked:
        group, rows = stacked[module]
        owner = attn if group == "qkv" else mlp
        param = getattr(owner, f"{group}_{kind}", None)
        return None if param is None else (param, rows)
    return None


def _is_norm(key: str) -> bool:
    return key.endswith("norm.weight")


def load_weights(model: LlamaForCausalLM, model_dir: str | Path, show_progress: bool = True) -> None:
    """Fill every parameter of `model` from the folder's safetensors; raise if any is missing."""
    model_dir = Path(model_dir)
    files = _safetensors_files(model_dir)
    filled: dict[int, int] = {}  # id(param) -> rows filled
    params = {id(p): (name, p) for name, p in model.named_parameters(remove_duplicate=True)}
    with tqdm(total=len(params), desc="loading weights", unit="tensor", disable=not show_progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    target = weight_target(model, key)
                    if target is None:
                        log.debug("checkpoint tensor unused", key=key)
                        continue
                    param, rows = target
                    tensor = f.get_tensor(key)
                    if model.config.norm_weight_offset and _is_norm(key):
                        tensor = tensor.float() + model.config.norm_weight_offset
                    dest = param.data[rows]
                    if dest.shape != tensor.shape:
                        raise UnsupportedModelError(
                            f"{key}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}"
                        )
                    dest.copy_(tensor)
                    filled[id(param)] = filled.get(id(param), 0) + tensor.shape[0]
                    if filled[id(param)] == param.shape[0]:
                        bar.update(1)
    missing = [name for pid, (name, p) in params.items() if filled.get(pid, 0) != p.shape[0]]
    if missing:
        raise UnsupportedModelError(f"{model_dir}: weights missing from the checkpoint: {missing[:5]}")


def load_model(
    config: ModelConfig, model_dir: str | Path, device: torch.device, dtype: torch.dtype, show_progress: bool = True
) -> LlamaForCausalLM:
    """Build the model for `config` on `device` in `dtype` and load its checkpoint weights."""
    with torch.device(device):
        model = LlamaForCausalLM(config).place(device, dtype)
    load_weights(model, model_dir, show_progress)
    return model
