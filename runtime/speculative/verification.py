"""Verification of one sequence's drafts against the target's logits rows: the tokens it emits, computed without
touching the sequence.

Position i is reached only if drafts 1..i-1 were kept, so its distribution is the one the plain
sampler would use once those drafts are the sequence's own tokens: its penalty counts, its
grammar's place and its min_tokens count as if they had been appended. A `Lookahead` is the
sequence in that state (copies, advanced draft by draft as the walk goes on), so the
sequence's own state changes only when the engine appends what the walk returns.

    rows:     | p(. | tokens) | p(. | tokens, d1) | ... | p(. | tokens, d1..dk) |
    walk:       d1 kept?  ->    d2 kept?  -> ...  ->  first refusal: a draw from the residual, and the run ends
                                                      (all kept: one more token from the last row)

The walk also ends after a kept draft that ends the sequence by a rule it can see (a stop
token id, EOS, the grammar complete or refusing); a stop string is the engine's check, which
cuts the tokens returned there.
"""

from __future__ import annotations

import torch

from runtime.batch import Drafts, SampledTokens
from runtime.request import Request, Sequence
from runtime.sampler import Sampler, penalty_counts
from runtime.sampling_params import SamplingParams
from runtime.stop_rules import stops_on_token


class Lookahead:
    """What the sampler reads of a sequence, as it would be with some drafts appended (copies: the sequence's
    own state never changes here)."""

    __slots__ = ("request", "params", "generator", "grammar", "penalty_counts", "num_output_tokens", "grammar_ended")

    def __init__(self, seq: Sequence, vocab_size: int, device: torch.device) -> None:
        self.request: Request = seq.request
        self.params: SamplingParams = seq.params
        self.generator = seq.generator  # the same draws, in the same order, as without lookahead
        self.grammar = seq.grammar.copy() if seq.grammar is not None else None
        # the first penalised step counts the sequence's tokens once (as the plain sampler would), then a copy
        self.penalty_counts = penalty_counts(seq, vocab_size, device).copy() if seq.params.has_penalties else None
        self.num_output_tokens = seq.num_output_tokens
        self.grammar_ended = False  # the grammar refused a draft or is complete: nothing can follow

    def append(self, token_id: int) -> None:
        """As if `token_id` (a kept draft) were the sequence's next token."""
        self.num_output_tokens += 1
        if self.penalty_counts is not None:
            self.penalty_counts.add(token_id)
        if self.grammar is not None:
            self.grammar_ended = not self.grammar.accept(token_id) or self.grammar.is_stopped


def verify_drafts(sampler: Sampler, rows: torch.Tensor,  # float32 [k + 1, vocab]
                  seq: Sequence, drafts: Drafts, eos_token_ids: frozenset[int]) -> SampledTokens:
    """The tokens `seq` emits from k drafts and their k + 1 rows: each kept draft, then the first token that is not
    one (a draw from the residual, or the bonus token after k kept); how many drafts were kept."""
    draft_ids = drafts.token_ids
    targets = sampler.argmax_rows(rows, seq)  # one call for the whole run where nothing in the state changes a row
    if targets is not None:
        num_accepted = 0
        while num_accepted < len(draft_ids) and targets[num_accepted] == draft_ids[num_accepted]:
            num_accepted += 1
            if stops_on_token(seq, draft_ids[num_accepted - 1], eos_token_ids):
                return SampledTokens(targets[:num_accepted], [None] * num_accepted, num_accepted)
        return SampledTokens(targets[: num_accepted + 1], [None] * (num_accepted + 1), num_accepted)
    tokens: list[int] = []
    logprobs: list[dict[int, float] | None] = []
    state: Sequence | Lookahead = seq  # position 0 reads the sequence as it is
    for i, draft in enumerate([*draft_ids, None]):
        q = drafts.probs[i] if drafts.probs is not None and draft is not None else None
        token_id, accepted, token_logprobs = sampler.verify_position(rows[i], state, draft, q)
        tokens.append(token_id)
        logprobs.append(token_logprobs)
        if not accepted:  # a refused draft, or the token after the last one: the run ends here
            return SampledTokens(tokens, logprobs, i)
        if stops_on_token(seq, token_id, eos_token_ids):
            return SampledTokens(tokens, logprobs, i + 1)
        if state is seq:
            state = Lookahead(seq, rows.shape[1], rows.device)
        state.append(token_id)  # the next position sees this draft kept
        if state.grammar_ended:
            return SampledTokens(tokens, logprobs, i + 1)
    raise RuntimeError("verification walked past its last row")  # the last position has no draft: never accepted
