"""The decoder of every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3), K/V in pages.

The model runs on a flat batch of tokens from many sequences (no padding): embeddings,
then per layer RMSNorm -> attention through the page tables -> residual -> RMSNorm ->
gated MLP -> residual, then a final norm. Logits are computed only for the rows that
sample. Numerics follow Hugging Face transformers (RMSNorm in float32, rotate-half RoPE).
What differs between families is ModelConfig data (runtime/model/config.py's table): q/k
norms, norms on the blocks' outputs (Gemma's "sandwich"), GeGLU, scaled embeddings, soft-caps,
a window and rope base per layer, partial rotary.

The residual stream is carried beside the normed activations, so that each residual sum
and the norm after it are one op (kernels/fused_ops.py: C++ on the CPU, torch elsewhere):

    normed = norm_in_0(residual)
    per layer:  normed = norm_post(residual += attention(normed))
                normed = norm_in_next(residual += mlp(normed))     (the final norm after the last)

With sandwich norms each block's output is normed first: residual += norm_attn_out(attention(normed)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused_ops
from runtime.attention import AttentionMetadata, paged_attention
from runtime.model import linear
from runtime.model.config import ModelConfig
from runtime.model.quantized import EncodedRows, QuantizedWeight
from runtime.model.rope import rope_cos_sin


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _weight(size)
        self.eps = eps

    def forward(self, x: torch.Tensor | None, residual: torch.Tensor, native: bool) -> torch.Tensor:
        """residual += x (in place, when x is given); returns the norm of the new residual."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps, native)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.window(layer)
        self.softcap = config.attn_logit_softcap
        self.local_rope = config.uses_local_rope(layer)
        self.partial_rotary = config.rotary_size != config.head_dim
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, config.hidden_size)  # q, k, v rows stacked
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size) if config.qkv_bias else None
        self.o_weight = _weight(config.hidden_size, self.q_size)
        self.o_bias = _weight(config.hidden_size) if config.o_bias else None
        self.qkv_packed: torch.Tensor | None = None  # oneDNN layouts, once packed (see pack_linear_weights)
        self.o_packed: torch.Tensor | None = None

    def forward(self, x, positions, cos, sin, k_cache, v_cache, meta: AttentionMetadata, native: bool) -> torch.Tensor:
        """x [num_tokens, hidden]; positions int64 [num_tokens]; cos, sin the whole float32 tables."""
        num_tokens = x.shape[0]
        qkv = linear.linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)  # [num_tokens, q + 2 * kv]
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv, native)
        q, k = fused_ops.rope_qkv(qkv, positions, cos, sin, self.num_heads, self.num_kv_heads, native,
                                  self.head_dim if self.partial_rotary else None)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window, self.softcap)
        return linear.linear(out.reshape(num_tokens, self.q_size), self.o_weight, self.o_bias, self.o_packed)

    def _norm_heads(self, qkv: torch.Tensor, native: bool) -> torch.Tensor:  # [num_tokens, q + 2 * kv]
        """qkv with each head of q and of k RMS-normed over head_dim (Qwen3's and Gemma 3's q/k norms)."""
        num_tokens, q_end = qkv.shape[0], self.q_size
        # contiguous copies (one KV head's slice reshapes to a strided view): [tokens * heads, head_dim]
        q = self.q_norm.forward(None, qkv[:, :q_end].reshape(-1, self.head_dim).contiguous(), native)
        k = self.k_norm.forward(None, qkv[:, q_end : q_end + self.kv_size].reshape(-1, self.head_dim).contiguous(),
                                native)
        return torch.cat((q.view(num_tokens, -1), k.view(num_tokens, -1), qkv[:, q_end + self.kv_size :]), dim=1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gelu = config.hidden_act == "gelu_tanh"  # GeGLU (Gemma); else SwiGLU
        self.gate_up_weight = _weight(2 * config.intermediate_size, config.hidden_size)  # gate rows, then up
        self.gate_up_bias = _weight(2 * config.intermediate_size) if config.mlp_bias else None
        self.down_weight = _weight(config.hidden_size, config.intermediate_size)
        self.down_bias = _weight(config.hidden_size) if config.mlp_bias else None
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, native: bool) -> torch.Tensor:
        gate_up = linear.linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)  # [n, 2 * inter]
        if self.gelu:
            hidden = fused_ops.gelu_tanh_and_mul(gate_up)  # [n, inter]
        else:
            hidden = fused_ops.silu_and_mul(gate_up, native)
        return linear.linear(hidden, self.down_weight, self.down_bias, self.down_packed)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # the MLP's input norm
        self.mlp = MLP(config)
        # sandwich norms (Gemma): on each block's output before its residual add; Gemma's names for the
        # three are post_attention_layernorm (-> attn_output_norm), pre_feedforward_layernorm (-> the MLP's
        # input norm above) and post_feedforward_layernorm (-> mlp_output_norm)
        sandwich = config.sandwich_norms
        self.attn_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.mlp_output_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(self, normed, residual, next_norm: RMSNorm, positions, cos, sin, k_cache, v_cache, meta,
                native: bool) -> torch.Tensor:
        """normed = this layer's input norm of `residual`; adds both blocks into `residual` in place
        and returns `next_norm` of the result (the next layer's input norm, or the final norm)."""
        # .forward, not __call__: no hooks are used, and a module call's checks cost ~1.3 us each, 150 a step
        attn = self.self_attn.forward(normed, positions, cos, sin, k_cache, v_cache, meta, native)
        if self.attn_output_norm is not None:
            attn = self.attn_output_norm.forward(None, attn, native)
        normed = self.post_attention_layernorm.forward(attn, residual, native)
        out = self.mlp.forward(normed, native)
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm.forward(None, out, native)
        return next_norm.forward(out, residual, native)


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers over paged K/V, final norm and the LM head (any family: the config says)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else _weight(config.vocab_size, config.hidden_size)
        self.lm_head_packed = None  # oneDNN layout of lm_head once packed, or its QuantizedWeight
        self.embed_rows = None  # set when the embedding table is kept quantized: .rows(ids, dtype) looks rows up
        # float32 [max_positions, rotary_size]; a model built on the meta device (the GGUF loader's) gets them in
        # place(): computed there, they would run torch's Python meta kernels, whose first call imports its
        # compiler stack (~200 MB resident in every server)
        self.rope_cos = self.rope_sin = None
        if torch.get_default_device().type != "meta":
            self.rope_cos, self.rope_sin = rope_cos_sin(config, config.max_position_embeddings)
        self.local_rope_cos = self.local_rope_sin = None  # Gemma 3's windowed layers' own tables (set by place)
        self.embedding_scale = None  # Gemma: a 0-d tensor in the weights' dtype (set by place)

    def place(self, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        """Move weights to `device` in `dtype`; the rotation tables stay float32 (as in transformers)."""
        self.to(device=device, dtype=dtype)
        cos, sin = rope_cos_sin(self.config, self.config.max_position_embeddings)
        self.rope_cos = cos.to(device)  # float32 [max_positions, rotary_size]
        self.rope_sin = sin.to(device)
        if self.config.local_rope_theta is not None:
            cos, sin = rope_cos_sin(self.config, self.config.max_position_embeddings, local=True)
            self.local_rope_cos, self.local_rope_sin = cos.to(device), sin.to(device)
        if self.config.embedding_scale is not None:  # rounded to the weights' dtype, as transformers scales Gemma's
            self.embedding_scale = torch.tensor(self.config.embedding_scale).to(device=device, dtype=dtype)
        return self.eval()

    def limit_positions(self, max_positions: int) -> None:
        """Keep the rotation tables' first `max_positions` rows only (the engine's: as many as its KV slots).

        Each row depends on its position alone, so the rows kept are unchanged; the rest is memory a
        128K-context model's tables would hold for positions the KV pages can never hold (Llama 3.2:
        64 MiB; Gemma 3's two sets: 128 MiB)."""
        for name in ("rope_cos", "rope_sin", "local_rope_cos", "local_rope_sin"):
            table = getattr(self, name)
            if table is not None and table.shape[0] > max_positions:
                setattr(self, name, table[:max_positions].clone())

    def pack_linear_weights(self) -> bool:
        """On the CPU, add oneDNN's packed layout of the layers' matmul weights (runtime/model/linear.py).

        The last step of loading (the packed copies do not follow later changes to the
        weights). Builds the packed path's primitives too. The LM head gets a packed copy as
        well (tied or not: the embedding lookup keeps the dense table); its primitives are
        built on first use of each row count, as its matmul dwarfs the build. Returns whether
        anything was packed.
        """
        packed = []
        for layer in self.layers:
            for module, name in ((layer.self_attn, "qkv"), (layer.self_attn, "o"), (layer.mlp, "gate_up"),
                                 (layer.mlp, "down")):
                weight = getattr(module, f"{name}_weight")
                if getattr(module, f"{name}_packed") is not None or not linear.can_pack(weight):
                    continue
                setattr(module, f"{name}_packed", linear.pack(weight))
                packed.append((weight, getattr(module, f"{name}_bias"), getattr(module, f"{name}_packed")))
        if self.lm_head_packed is None and linear.can_pack(self.lm_head):
            self.lm_head_packed = linear.pack(self.lm_head)
        with torch.inference_mode():
            linear.warm_up(packed)
        return bool(packed)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        residual = self.embed(input_ids)  # updated in place
        native = fused_ops.native_for(residual)
        normed = self.layers[0].input_layernorm.forward(None, residual, native)
        norms_after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, (k_cache, v_cache) in zip(self.layers, norms_after, kv_caches):
            local = layer.self_attn.local_rope
            cos, sin = (self.local_rope_cos, self.local_rope_sin) if local else (self.rope_cos, self.rope_sin)
            normed = layer.forward(normed, residual, next_norm, positions, cos, sin, k_cache, v_cache, meta, native)
        return normed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # int64 [num_tokens] -> [num_tokens, hidden_size]
        """The rows of `input_ids` from the embedding table (a fresh tensor), scaled where the family scales them."""
        if self.embed_rows is None:
            residual = F.embedding(input_ids, self.embed_tokens)
        else:
            residual = self.embed_rows.rows(input_ids, self.norm.weight.dtype)
        if self.embedding_scale is not None:
            residual = residual * self.embedding_scale
        return residual

    def linear_slots(self) -> list[tuple[nn.Module, str]]:
        """(module, name) of every matmul weight: `{name}_weight`, `{name}_bias`, `{name}_packed` on the module."""
        slots = []
        for layer in self.layers:
            slots += [(layer.self_attn, "qkv"), (layer.self_attn, "o"), (layer.mlp, "gate_up"), (layer.mlp, "down")]
        return slots

    def weight_bytes(self) -> int:
        """Bytes the weights hold: parameters plus quantized forms (a tied table counted once)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        forms = [getattr(module, f"{name}_packed") for module, name in self.linear_slots()]
        forms += [self.lm_head_packed, self.embed_rows]
        unique = {id(form): form for form in forms if isinstance(form, (QuantizedWeight, EncodedRows))}
        return total + sum(form.nbytes() for form in unique.values())  # oneDNN's packed copies are not counted

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab_size], float32
        logits = linear.linear(hidden, self.lm_head, None, self.lm_head_packed)
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), in the model's dtype as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
