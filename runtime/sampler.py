"""Pick each sequence's next token from its logits row.

Order per row: logprobs of the raw distribution (when asked) -> logit_bias -> min_tokens (EOS
and stop ids out until then; from a grammar's allowed ids only where others remain) -> penalties ->
the grammar's allowed tokens (constrained rows only: the rest of the row is dropped) ->
greedy argmax, or temperature -> top_k -> top_p -> min_p -> a draw. The draw for a seeded sequence uses
only that sequence's own generator (one draw per token), so its output does not depend
on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kernels.token_mask import allowed_token_ids
from runtime.grammar import fill_bitmasks
from runtime.request import Sequence
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


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:  # [vocab]
    """Repetition penalty over prompt + output (HF style); presence/frequency over output (OpenAI)."""
    params = seq.params
    if seq.penalty_counts is None:
        seq.penalty_counts = PenaltyCounts.from_tokens(seq.token_ids, seq.num_prompt_tokens, logits.shape[0],
                                                       logits.device)
    counts = seq.penalty_counts
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(counts.seen, penalised, logits)
    if params.presence_penalty or params.frequency_penalty:
        output = counts.output_counts
        logits -= params.frequency_penalty * output + params.presence_penalty * (output > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:  # [vocab]
    """Mask (to -inf) the tokens that top_k, top_p and min_p rule out; logits already tempered."""
    if top_k > 0 and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False  # the best token always stays (top_p=0 keeps only it)
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def tempered_probs(row: torch.Tensor, params) -> torch.Tensor:  # [len(row)]
    """softmax of the row tempered, then top-k / top-p / min-p filtered (what a sampled draw uses)."""
    return torch.softmax(filter_logits(row / params.temperature, params.top_k, params.top_p, params.min_p), dim=-1)


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
            token_ids = [self._sample_row(logits[i], seq, allowed.get(i)) for i, seq in enumerate(seqs)]
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

    def _sample_row(self, row: torch.Tensor, seq: Sequence, allowed: torch.Tensor | None = None) -> int:
        """One token for one sequence; with `allowed` (a grammar's ids) only among those."""
        return self._pick(row, seq, allowed, None)[0]

    def _pick(self, row: torch.Tensor, seq: Sequence, allowed: torch.Tensor | None,
              draft: int | None, q: torch.Tensor | None = None) -> tuple[int, bool]:
        """(token, whether it is `draft`): a plain draw without a draft, else the exact rejection rule
        (`q` [vocab]: the draft's distribution; None: one-hot)."""
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
                choice, accepted = draw(probs, generator), False
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
        return tempered_probs(row, params)

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
