"""Runs one scheduled batch through the model: page copies, inputs, forward, logits.

It owns the KV cache tensors, sized once from a budget and never grown:
    kv_cache  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
"""

from __future__ import annotations

import torch

import kernels
from runtime.attention import AttentionMetadata
from runtime.model.llama import LlamaForCausalLM
from runtime.model.native_decode import NativeDecodeStep
from runtime.batch import ScheduledBatch


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:  # int32 [len(rows), max_len]
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device).reshape(
        len(rows), width
    )


class ModelRunner:
    """The model plus its paged KV cache; turns a ScheduledBatch into logits rows."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kernel_backend: str = "auto",
    ) -> None:
        config = model.config
        self.model = model
        model.pack_linear_weights()  # CPU: oneDNN's packed layout (a no-op elsewhere)
        if device.type == "cpu":
            kernels.prepare_cpu_kernels()  # built before the engine is ready, not during a first request
        self.block_size = block_size
        self.device = device
        self.kernel_backend = kernel_backend
        self.attention = kernels.attention_backend(kernel_backend)  # its kernels, asked by its flags
        self.kv_cache = torch.zeros(
            config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype=dtype, device=device
        )  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.layer_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(config.num_layers)]
        # decode steps' layers in one C++ call where the model allows (None: the Python forward for every step)
        self.native_decode = NativeDecodeStep.build(model, self.layer_caches, self.attention)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (every layer, K and V): copy-on-write for shared partial pages."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, rows that sample) for the batch."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        context_lens: list[int] = []
        query_start = [0]  # offsets of the chunks' rows, which follow the decode tokens
        sample_rows: list[int] = []
        num_decode_tokens = 0
        owners: list[int] = []  # per decode token, its entry: one sequence's verification rows never share a group
        for i, entry in enumerate(batch.entries):
            start = entry.start_position
            end = start + len(entry.token_ids)
            table = entry.block_table
            input_ids += entry.token_ids
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if i < batch.num_decodes:  # each token a decode query, seeing the positions up to its own
                tables += [table] * len(entry.token_ids)
                context_lens += range(start + 1, end + 1)
                owners += [i] * len(entry.token_ids)
                num_decode_tokens += len(entry.token_ids)
            else:
                tables.append(table)
                context_lens.append(end)
                query_start.append(query_start[-1] + len(entry.token_ids))
            sample_end = len(input_ids)
            sample_rows += range(sample_end - entry.num_sample_rows, sample_end)
        nd = num_decode_tokens
        device = self.device
        plans = None
        config = self.model.config
        if nd and self.attention.reads_decode_plans and config.attn_logit_softcap is None:  # a plan per window
            plans = {window: kernels.plan_decode(tables[:nd], context_lens[:nd], bs, window, device,
                                                 owners=owners if nd > batch.num_decodes else None)  # a verification
                     for window in config.windows}
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_decode_tokens=nd,
            decode_block_tables=_padded(tables[:nd], device) if plans is None else None,  # else in the plans
            decode_context_lens=torch.tensor(context_lens[:nd], dtype=torch.int32, device=device),
            prefill_block_tables=_padded(tables[nd:], device),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),  # chunk rows
            prefill_context_lens=torch.tensor(context_lens[nd:], dtype=torch.int32, device=device),
            backend=self.attention,
            decode_plans=plans,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            torch.tensor(sample_rows, dtype=torch.int64, device=device),
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:  # float32 [num_sample_rows, vocab]
        """Run the batch: page copies first, then the forward; logits only for the rows that sample."""
        self.copy_blocks(batch.blocks_to_copy)
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        if self.native_decode is not None and self.native_decode.serves(meta, input_ids.shape[0]):
            hidden = self.native_decode.forward(input_ids, positions, meta)  # [num_tokens, hidden_size]
        else:
            hidden = self.model(input_ids, positions, self.layer_caches, meta)
        if sample_rows.shape[0] != hidden.shape[0]:  # else every token samples (a decode step): no gather
            hidden = hidden[sample_rows]
        return self.model.compute_logits(hidden)
