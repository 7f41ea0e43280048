"""A decode step's decoder layers in one C++ call (kernels/decode_step.py), where the model and step allow.

The Python forward (runtime/model/llama.py) makes ~15 operations a layer, each a Python call, a
module call into C++ and a few tensor views: 0.1-0.2 ms a layer on a 2-core CPU, a third of a
SmolLM2 decode step. NativeDecodeStep hands the same operations to C++ in one call for all the
layers. It calls the same kernel functions, so the hidden rows are the Python path's to the bit
(tests/runtime/test_native_decode.py), and the embedding lookup and LM head stay where they are.

It serves (`build` says why not, once, in the log):
    a model on the CPU in float32 activations whose every layer matmul is GGUF-grouped
    (GroupedWeight or SplitGroupedWeight), without soft-capped attention or partial rotary;
and, per step (`serves`), a batch of decode tokens only (plain decodes or a speculative
verification's rows), rows sharing prefix pages included (the cascade of kernels/cascade.py: the
shared pages read once per group, merged through the log-sum-exps, by the same ops in C++); a
step with prefill chunks takes the Python forward.
"""

from __future__ import annotations

import structlog
import torch

import kernels
from kernels import decode_step, grouped_matmul
from runtime.attention import AttentionMetadata
from runtime.model.grouped import GroupedWeight, SplitGroupedWeight
from runtime.model.llama import LlamaForCausalLM
from runtime.model.quantized import QuantizedWeight

_log = structlog.get_logger(__name__)


def _matmul(weight, bias: torch.Tensor | None) -> dict:
    """A matmul's spec for the C++ step: its row blocks' kernel arguments, and its bias."""
    parts = weight.parts if isinstance(weight, SplitGroupedWeight) else [weight]
    return {"blocks": [part.kernel_arguments() for part in parts], "bias": bias}


def _unserved(model: LlamaForCausalLM) -> str | None:
    """Why the native step cannot serve `model`, or None where it can."""
    config = model.config
    if model.norm.weight.device.type != "cpu" or model.norm.weight.dtype != torch.float32:
        return "not float32 on the CPU"
    if config.attn_logit_softcap is not None:
        return "soft-capped attention"
    if config.rotary_size != config.head_dim:
        return "partial rotary"
    for module, name in model.linear_slots():
        form = getattr(module, f"{name}_packed")
        if not isinstance(form, (GroupedWeight, SplitGroupedWeight)):
            return f"matmul weight {name} is {type(form).__name__ if isinstance(form, QuantizedWeight) else 'dense'}"
        if any(part.padded_outputs for part in (form.parts if isinstance(form, SplitGroupedWeight) else [form])):
            return f"matmul weight {name}'s outputs are not a multiple of {grouped_matmul.PANEL}"
    if not decode_step.available():
        return "the C++ kernels are not built"
    return None


class NativeDecodeStep:
    """The model's decoder layers over a decode step's rows, in one C++ call."""

    def __init__(self, model: LlamaForCausalLM, layer_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        config = model.config
        self.model = model
        self.windows = config.windows
        self.group_size = config.num_heads // config.num_kv_heads
        self.cache_dtype = layer_caches[0][0].dtype
        self._no_rows = torch.empty(0, dtype=torch.bool)  # a plan's shared prefixes without a window's empty rows
        self.step = decode_step.new_step(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                         config.attention_scale, model.layers[0].input_layernorm.weight)
        norms_after = [layer.input_layernorm for layer in model.layers[1:]] + [model.norm]
        for i, (layer, next_norm, (k_cache, v_cache)) in enumerate(zip(model.layers, norms_after, layer_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            self.step.add_layer({
                "qkv": _matmul(attn.qkv_packed, attn.qkv_bias), "o": _matmul(attn.o_packed, attn.o_bias),
                "gate_up": _matmul(mlp.gate_up_packed, mlp.gate_up_bias), "down": _matmul(mlp.down_packed, mlp.down_bias),
                "post_attention_norm": layer.post_attention_layernorm.weight, "next_norm": next_norm.weight,
                "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
                "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
                "attn_output_norm": None if layer.attn_output_norm is None else layer.attn_output_norm.weight,
                "mlp_output_norm": None if layer.mlp_output_norm is None else layer.mlp_output_norm.weight,
                "k_cache": k_cache, "v_cache": v_cache,
                "window_index": self.windows.index(config.window(i)), "local_rope": attn.local_rope, "gelu": mlp.gelu,
            })

    @classmethod
    def build(cls, model: LlamaForCausalLM, layer_caches: list[tuple[torch.Tensor, torch.Tensor]],
              attention: kernels.AttentionBackend) -> NativeDecodeStep | None:
        """The native step for `model`, or None (logged with the reason) where it cannot serve it."""
        reason = f"the {attention.name} kernels run attention" if not attention.runs_native_decode else _unserved(model)
        if reason is not None:
            _log.info("native_decode.off", reason=reason)
            return None
        _log.info("native_decode.on", layers=model.config.num_layers)
        return cls(model, layer_caches)

    def serves(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step is decode tokens only, each plan's private parts for the C++ kernel."""
        if meta.num_decode_tokens != num_tokens or num_tokens == 0 or meta.decode_plans is None:
            return False
        return all(plan.native is not None for plan in meta.decode_plans.values())

    def _shared(self, plan) -> list[torch.Tensor]:
        """A plan's shared prefixes as the C++ step takes them ([] for none): cascade.py's tensors."""
        shared = plan.shared
        if shared is None:
            return []
        bias = shared.bias_for(self.group_size, self.cache_dtype)  # [groups, 1, members * group size, Ls]
        empty = shared.empty if shared.empty is not None else self._no_rows
        return [shared.tables, shared.member_rows, bias, shared.rows, shared.slots, empty]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:  # float32 [num_tokens, hidden_size]
        """The model's forward for a step that `serves` accepts: the final norm of each row's residual."""
        model = self.model
        plans = [meta.decode_plans[window] for window in self.windows]
        rows = [plan.native for plan in plans]
        local_cos = model.local_rope_cos if model.local_rope_cos is not None else model.rope_cos
        local_sin = model.local_rope_sin if model.local_rope_sin is not None else model.rope_sin
        return self.step.forward(model.embed(input_ids), positions, meta.slot_mapping, [r.tables for r in rows],
                                 [r.starts for r in rows], [r.ends for r in rows], [self._shared(p) for p in plans],
                                 model.rope_cos, model.rope_sin, local_cos, local_sin)
