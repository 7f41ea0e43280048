"""Pick each sequence's next token from its logits row.

Order per row: logprobs of the raw distribution (when asked) -> logit_bias -> min_tokens (EOS
and stop ids out until then; from a grammar's allowed ids only where others remain) -> penalties ->
the grammar's allowed tokens (constrained rows only: the rest of the row is dropped) ->
greedy argmax, or temperature -> top_k -> top_p -> min_p -> a draw. The draw for a seeded sequence uses
only that sequence's own generator (one draw per token), so its output does not depend
on what else is in the batch.

The rows without a grammar go together, in batch form (runtime/sampling/: a SamplingMetadata of
the step's parameters, then row-wise tensor ops: penalties, filters, one draw per row); a grammar's
row, and each verified position, runs the same ops as a batch of one, so every path gives a row
the same distribution.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kernels.token_mask import allowed_token_ids
from runtime.grammar import fill_bitmasks
from runtime.request import Sequence
from runtime.sampling import ops
from runtime.sampling.metadata import SamplingMetadata
from runtime.speculative.rejection import draw, residual_distribution, verify_draft


@dataclass
class PenaltyCounts:
    """One sequence's token counts for penalties, kept up to date as tokens are added.

    Built once from the tokens so far (the first penalised step), then one update per token,
    so a penalised step costs O(vocab), not O(tokens).
    """

    seen: torch.Tensor  # bool [vocab]; in the prompt or the output
    output_counts: torch.Tensor  # float32 [vocab]; times each token was generated

    @classmethod
    def from_tokens(cls, token_ids: list[int], num_prompt_tokens: int, vocab_size: int,
                    device: torch.device | None = None) -> PenaltyCounts:
        """Counts of `token_ids` (the first `num_prompt_tokens` of them the prompt), on the logits' device."""
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[torch.tensor(token_ids, dtype=torch.long, device=device)] = True
        outputs = torch.tensor(token_ids[num_prompt_tokens:], dtype=torch.long, device=device)
        return cls(seen, torch.bincount(outputs, minlength=vocab_size).float())

    def add(self, token_id: int) -> None:
        self.seen[token_id] = True
        self.output_counts[token_id] += 1

    def copy(self) -> PenaltyCounts:
        return PenaltyCounts(self.seen.clone(), self.output_counts.clone())


def _column(value: float) -> torch.Tensor:  # float32 [1, 1]
    return torch.tensor([[value]], dtype=torch.float32)


def penalty_counts(seq: Sequence, vocab_size: int, device: torch.device) -> PenaltyCounts:
    """The sequence's counts, made from its tokens on its first penalised step, then kept up to date."""
    if seq.penalty_counts is None:
        seq.penalty_counts = PenaltyCounts.from_tokens(seq.token_ids, seq.num_prompt_tokens, vocab_size, device)
    return seq.penalty_counts


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:  # [vocab]
    """Repetition penalty over prompt + output (HF style); presence/frequency over output (OpenAI): ops.penalise
    on one row."""
    params = seq.params
    counts = penalty_counts(seq, logits.shape[0], logits.device)
    return ops.penalise(logits[None], counts.seen[None], counts.output_counts[None],
                        _column(params.repetition_penalty), _column(params.presence_penalty),
                        _column(params.frequency_penalty))[0]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:  # [vocab]
    """Mask (to -inf) the tokens that top_k, top_p and min_p rule out; logits already tempered (one row of
    ops.filter_rows)."""
    return ops.filter_rows(logits[None], torch.tensor([top_k]), _column(top_p), _column(min_p))[0]


def tempered_probs(row: torch.Tensor, params) -> torch.Tensor:  # [len(row)]
    """softmax of the row tempered, then top-k / top-p / min-p filtered (what a sampled draw uses)."""
    return ops.tempered_probs(row[None], _column(params.temperature), torch.tensor([params.top_k]),
                              _column(params.top_p), _column(params.min_p))[0]


def held_back(seq: Sequence) -> torch.Tensor | None:  # int64 [m]
    """The token ids min_tokens keeps from `seq`'s next token (EOS, stop ids), or None when nothing is held."""
    held = seq.request.min_tokens_held_back
    return held if held is not None and seq.num_output_tokens < seq.params.min_tokens else None


class Sampler:
    """Turns a step's logits rows into one token (and optional logprobs) per sequence."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for sequences without a seed
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)  # int32 [rows, ceil(vocab / 32)], grown as needed

    def __call__(
        self, logits: torch.Tensor, seqs: SequenceOf[Sequence]  # logits: float32 [num_seqs, vocab]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        logits = logits.float().cpu()
        need_logprobs = any(s.params.logprobs is not None for s in seqs)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None  # [num_seqs, vocab]
        logits = self._adjusted(logits, seqs)
        allowed = self._allowed_ids(logits.shape[1], seqs)  # row -> the ids its grammar allows
        if all(s.params.is_greedy and not s.params.has_penalties for s in seqs):
            token_ids = logits.argmax(dim=-1).tolist()
            for i, ids in allowed.items():
                token_ids[i] = int(ids[logits[i, ids].argmax()])
        else:
            token_ids = self._sample_rows(logits, seqs, allowed)
        token_logprobs = [
            self._logprobs(logprobs[i], token_ids[i], seq.params.logprobs) if seq.params.logprobs is not None else None
            for i, seq in enumerate(seqs)
        ]
        return token_ids, token_logprobs

    @staticmethod
    def _adjusted(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:  # [rows, vocab]
        """logit_bias added, and min_tokens' held-back ids (EOS, stop ids) set to -inf in rows without a
        grammar (a grammar row drops them from its allowed ids instead); a copy only where a row changes."""
        biased = [(i, seq.request.logit_bias) for i, seq in enumerate(seqs) if seq.request.logit_bias is not None]
        held = [(i, ids) for i, seq in enumerate(seqs) if (ids := held_back(seq)) is not None and seq.grammar is None]
        if biased or held:
            logits = logits.clone()  # the caller's rows (the runner's inference tensor) stay as they came
        for i, (token_ids, biases) in biased:
            logits[i, token_ids] += biases
        for i, token_ids in held:
            logits[i, token_ids] = float("-inf")
        return logits

    def _allowed_ids(self, vocab_size: int, seqs: SequenceOf[Sequence]) -> dict[int, torch.Tensor]:
        """The constrained rows' grammars fill their bitmask rows (together); the allowed ids of each (int64, ascending).

        A row whose grammar allows nothing (an engine fault) is left unconstrained here; the
        grammar then refuses the token and the engine ends the sequence.
        """
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return {}
        words = -(-vocab_size // 32)
        if self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != words:
            self._bitmask = torch.empty(max(len(rows), self._bitmask.shape[0]), words, dtype=torch.int32)
        fill_bitmasks([seqs[i].grammar for i in rows], self._bitmask)
        ids = allowed_token_ids(self._bitmask[: len(rows)], vocab_size)
        allowed = {}
        for i, row_ids in zip(rows, ids):
            held = held_back(seqs[i])
            if held is not None:  # min_tokens: not yet EOS or a stop id, unless the grammar allows nothing else
                kept = row_ids[~torch.isin(row_ids, held)]
                row_ids = kept if kept.numel() else row_ids
            if row_ids.numel():
                allowed[i] = row_ids
        return allowed

    def _sample_rows(self, logits: torch.Tensor, seqs: SequenceOf[Sequence],  # logits: float32 [rows, vocab]
                     allowed: dict[int, torch.Tensor]) -> list[int]:
        """One token per row: the rows without a grammar together (penalties, argmax or filters and a draw, as
        tensors), a grammar's row among its allowed ids. Every sampled row's uniform is drawn first, in row order."""
        meta = SamplingMetadata.build([seq.params for seq in seqs])
        uniforms = {i: torch.rand((), dtype=torch.float64, generator=seq.generator or self.generator)
                    for i, seq in enumerate(seqs) if not meta.greedy[i]}
        token_ids = [0] * len(seqs)
        for i, ids in allowed.items():
            token_ids[i] = self._pick(logits[i], seqs[i], ids, None, uniform=uniforms.get(i))[0]
        free = [i for i in range(len(seqs)) if i not in allowed]
        if not free:
            return token_ids
        rows, free_meta = logits, meta
        if len(free) < len(seqs):
            rows, free_meta = logits[torch.tensor(free, dtype=torch.int64)], meta.rows(free)
        if free_meta.penalised:
            rows = self._penalised(rows, [seqs[i] for i in free], free_meta)
        greedy = [j for j, i in enumerate(free) if meta.greedy[i]]
        if greedy:
            picked = rows[torch.tensor(greedy, dtype=torch.int64)].argmax(dim=-1).tolist()
            for j, token_id in zip(greedy, picked):
                token_ids[free[j]] = token_id
        sampled = [j for j, i in enumerate(free) if not meta.greedy[i]]
        if sampled:
            chosen = free_meta.rows(sampled) if len(sampled) < len(free) else free_meta
            at = torch.tensor(sampled, dtype=torch.int64)
            probs = self.target_probs_rows(rows[at] if len(sampled) < len(free) else rows, chosen)
            picked = ops.draw_rows(probs, torch.stack([uniforms[free[j]] for j in sampled]))
            for j, token_id in zip(sampled, picked):
                token_ids[free[j]] = token_id
        return token_ids

    @staticmethod
    def _penalised(rows: torch.Tensor, seqs: list[Sequence], meta: SamplingMetadata) -> torch.Tensor:
        """`rows` [rows, vocab] with the penalised rows' penalties applied (a new tensor; the others as they are)."""
        at = torch.tensor(meta.penalised, dtype=torch.int64)
        counts = [penalty_counts(seqs[j], rows.shape[1], rows.device) for j in meta.penalised]
        penalised = ops.penalise(rows[at], torch.stack([c.seen for c in counts]),
                                 torch.stack([c.output_counts for c in counts]), meta.repetition_penalty[at],
                                 meta.presence_penalty[at], meta.frequency_penalty[at])
        return rows.index_put((at,), penalised)

    def _pick(self, row: torch.Tensor, seq: Sequence, allowed: torch.Tensor | None,
              draft: int | None, q: torch.Tensor | None = None, uniform: torch.Tensor | None = None) -> tuple[int, bool]:
        """(token, whether it is `draft`): a plain draw without a draft (`uniform`: its draw, made already), else
        the exact rejection rule (`q` [vocab]: the draft's distribution; None: one-hot)."""
        params = seq.params
        if params.has_penalties:
            row = apply_penalties(row, seq)
        index = None  # the draft's place in `row` once restricted; None: not among the allowed ids
        if draft is not None:
            index = draft
            if allowed is not None:
                at = int(torch.searchsorted(allowed, draft))
                index = at if at < allowed.shape[0] and int(allowed[at]) == draft else None
        if allowed is not None:
            row = row[allowed]  # [num_allowed]: what follows costs O(allowed), not O(vocab)
            if q is not None:
                q = q[allowed]  # p is 0 elsewhere, so max(p - q, 0) is too: the rule only needs q here
        if params.is_greedy:
            choice = int(row.argmax())
            accepted = index is not None and choice == index
        else:
            probs = self.target_probs(row, params)
            generator = seq.generator or self.generator
            if draft is None:
                # Inverse CDF: one uniform draw per token (so a seeded sequence's draws do not depend on
                # the batch); a token of probability 0 is never chosen
                choice, accepted = draw(probs, generator, uniform), False
            elif index is None:  # the grammar refuses the draft: p(d) = 0, rejected; the residual is p (one-hot q)
                torch.rand((), dtype=torch.float64, generator=generator)  # the acceptance draw, spent as always
                residual = probs if q is None else residual_distribution(probs, q, 0)
                choice, accepted = draw(residual, generator), False
            else:
                choice, accepted = verify_draft(probs, q, index, generator)
        return (int(allowed[choice]) if allowed is not None else choice), accepted

    @staticmethod
    def argmax_rows(rows: torch.Tensor, seq: Sequence) -> list[int] | None:  # rows: [k + 1, vocab]
        """Every row's token at once where nothing in the sequence's state changes a row (greedy, no bias,
        penalties, grammar or logprobs): its argmax; None where rows must go one at a time (verify_position)."""
        params = seq.params
        if (params.is_greedy and not params.has_penalties and seq.grammar is None and seq.request.logit_bias is None
                and params.logprobs is None and seq.num_output_tokens >= params.min_tokens):
            return rows.argmax(dim=-1).tolist()
        return None

    @staticmethod
    def target_probs(row: torch.Tensor, params) -> torch.Tensor:  # [len(row)]
        """The distribution a sampled token is drawn from: the (penalised, restricted) row tempered, then filtered."""
        return Sampler.target_probs_rows(row[None], SamplingMetadata.build([params]))[0]

    @staticmethod
    def target_probs_rows(rows: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:  # [rows, vocab]
        """target_probs for a batch of rows (every sampled row's distribution comes from here, one or many)."""
        return ops.tempered_probs(rows, meta.temperature, meta.top_k, meta.top_p, meta.min_p)

    def verify_position(self, row: torch.Tensor, seq: Sequence, draft: int | None,
                        q: torch.Tensor | None = None) -> tuple[int, bool, dict[int, float] | None]:  # row: float32 [vocab]
        """The token one verified position emits for `seq`, in its state now (tokens so far, grammar, penalties):
        the sequence itself, or a verification's Lookahead (runtime/speculative/verification.py) of it.

        With a deterministic `draft` (q None): (the draft, True) with probability p(draft), else a
        draw from p without it. With `q` [vocab], the distribution the draft was drawn from: kept
        with probability min(1, p/q), else a draw from norm(max(p - q, 0)). Greedy keeps the draft
        exactly when it is the argmax. Without a draft (the position after the last one): an
        ordinary draw. Also the token's logprobs when asked (raw row, as __call__ gives them).
        """
        row = row.float().cpu()
        params = seq.params
        logprobs = torch.log_softmax(row, dim=-1) if params.logprobs is not None else None
        row = self._adjusted(row[None], [seq])[0]
        allowed = self._allowed_ids(row.shape[0], [seq]).get(0)
        token_id, accepted = self._pick(row, seq, allowed, draft, q)
        token_logprobs = self._logprobs(logprobs, token_id, params.logprobs) if logprobs is not None else None
        return token_id, accepted, token_logprobs

    @staticmethod
    def _logprobs(row: torch.Tensor, token_id: int, num_top: int) -> dict[int, float]:
        """The chosen token's logprob, then the top `num_top` tokens' (chosen first)."""
        chosen = {token_id: float(row[token_id])}
        if num_top:
            values, ids = torch.topk(row, num_top)
            for value, top_id in zip(values.tolist(), ids.tolist()):
                chosen.setdefault(top_id, value)
        return chosen
