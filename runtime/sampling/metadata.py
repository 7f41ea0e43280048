"""One step's sampling parameters, one row per sequence that samples, as tensors: built once per step."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from runtime.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """The rows' parameters (row i is seqs[i]) for the batched filters, penalties and draws."""

    greedy: list[bool]  # per row: argmax, no draw
    temperature: torch.Tensor  # float32 [rows, 1]; 1 on greedy rows (never divided by)
    top_k: torch.Tensor  # int64 [rows]; 0: off
    top_p: torch.Tensor  # float32 [rows, 1]; 1: off
    min_p: torch.Tensor  # float32 [rows, 1]; 0: off
    repetition_penalty: torch.Tensor  # float32 [rows, 1]; 1: off
    presence_penalty: torch.Tensor  # float32 [rows, 1]
    frequency_penalty: torch.Tensor  # float32 [rows, 1]
    penalised: list[int]  # rows with any penalty

    @classmethod
    def build(cls, params: SequenceOf[SamplingParams]) -> SamplingMetadata:
        """Row i from params[i] (a sequence's)."""
        greedy = [p.is_greedy for p in params]

        def column(values: list[float]) -> torch.Tensor:  # float32 [rows, 1]
            return torch.tensor(values, dtype=torch.float32).reshape(len(values), 1)

        return cls(
            greedy=greedy,
            temperature=column([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=column([p.top_p for p in params]),
            min_p=column([p.min_p for p in params]),
            repetition_penalty=column([p.repetition_penalty for p in params]),
            presence_penalty=column([p.presence_penalty for p in params]),
            frequency_penalty=column([p.frequency_penalty for p in params]),
            penalised=[i for i, p in enumerate(params) if p.has_penalties],
        )

    def rows(self, indices: list[int]) -> SamplingMetadata:
        """The metadata of these rows only, in this order."""
        at = torch.tensor(indices, dtype=torch.int64)
        penalised = set(self.penalised)
        return SamplingMetadata(
            greedy=[self.greedy[i] for i in indices], temperature=self.temperature[at], top_k=self.top_k[at],
            top_p=self.top_p[at], min_p=self.min_p[at], repetition_penalty=self.repetition_penalty[at],
            presence_penalty=self.presence_penalty[at], frequency_penalty=self.frequency_penalty[at],
            penalised=[j for j, i in enumerate(indices) if i in penalised],
        )
