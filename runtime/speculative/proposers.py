"""Proposers: something cheap that drafts the next tokens of a running sequence.

One small protocol: `propose(seq, k)` returns up to k draft tokens for the sequence as it is now
(prompt + outputs so far), and `forget(seq)` drops what it kept for a sequence that ended (a
proposer that learns from answers keeps the finished one there).
Every proposer here is deterministic (its q is one-hot), so verification accepts a draft with
the target's own probability of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from config import SpeculativeConfig
from runtime.request import Sequence
from runtime.speculative.ngram import NgramIndex
from runtime.speculative.suffix import SuffixCache


class Proposer(Protocol):
    """Drafts for one sequence at a time; state per sequence id, dropped by forget.

    `source` names where the last `propose` drafted from, one of `sources`: the engine keeps
    acceptance per source.
    """

    sources: tuple[str, ...]
    source: str

    def propose(self, seq: Sequence, k: int) -> list[int]: ...

    def forget(self, seq: Sequence) -> None: ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): the latest earlier occurrence of the longest matching suffix."""

    sources = ("prompt_lookup",)
    source = "prompt_lookup"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min = n_min
        self.n_max = n_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_matched(seq, k)[0]

    def propose_matched(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """(drafts, the length of the suffix that matched; 0 with no drafts)."""
        index = self.indexes.get(seq.seq_id)
        if index is None:
            index = self.indexes[seq.seq_id] = NgramIndex(self.n_min, self.n_max)
        return index.propose_matched(seq.token_ids, k)

    def forget(self, seq: Sequence) -> None:
        self.indexes.pop(seq.seq_id, None)


class SuffixProposer:
    """Suffix decoding (vLLM's "suffix"): the sequence's own prompt and output, and its scope's past answers.

    Two sources, as Arctic Inference has them: the sequence itself (prompt lookup over its prompt
    and output, as `NgramProposer`), and the past answers of requests in the same cache scope
    (`SuffixCache`, which counts how often each continuation followed). The past answers draft
    only on a match longer than the sequence's own and at least MIN_PAST_MATCH tokens: one
    common token says little about where another answer went. A finished answer joins its
    scope's record when its sequence is forgotten.
    """

    sources = ("prompt_lookup", "past_answers")
    MIN_PAST_MATCH = 2

    def __init__(self, n_min: int, n_max: int, max_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float, max_drafts: int) -> None:
        self.own = NgramProposer(n_min, n_max)
        self.cache = SuffixCache(max_depth, max_cached_requests)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_match = max(1, max_depth - max_drafts)  # a match leaves room in the trie for k drafts
        # the prompt's last tokens kept before an answer: a question asked again matches from its start
        self.prompt_tail = self.max_match
        self.source = "prompt_lookup"

    def propose(self, seq: Sequence, k: int) -> list[int]:
        own, own_match = self.own.propose_matched(seq, k)
        self.source = "prompt_lookup"
        trie = self.cache.trie(seq.request.cache_salt)
        if trie is None:
            return own
        past, _ = trie.propose(seq.token_ids, k, self.max_match, self.max_spec_factor, self.min_token_prob,
                                   min_match=max(self.MIN_PAST_MATCH, own_match + 1))
        if past:
            self.source = "past_answers"
            return past
        return own

    def forget(self, seq: Sequence) -> None:
        self.own.forget(seq)
        request = seq.request
        if seq.finish_reason in ("stop", "length") and request.pin_id is None and seq.num_output_tokens:
            start = max(0, seq.num_prompt_tokens - self.prompt_tail)
            self.cache.add(request.cache_salt, seq.token_ids[start:])


class _PredictionCursor:
    """Where one sequence's output stands in its request's predicted tokens."""

    __slots__ = ("position", "last_aligned", "num_checked", "follow")

    def __init__(self) -> None:
        self.position: int | None = 0  # the predicted token expected next; None: lost, realign
        self.last_aligned = 0  # the position the output last followed the prediction to
        self.num_checked = 0  # output tokens compared with the prediction so far
        # n-gram of the prediction -> the positions right after it, ascending; built on the first realign
        self.follow: dict[tuple[int, ...], list[int]] | None = None


class PredictionProposer:
    """OpenAI's Predicted Outputs: the caller's expected text, tokenized, is the draft.

    While the output follows the prediction, the draft is the prediction's next k tokens. Where
    the output departs from it, the cursor is lost; it is found again where the output's last
    REALIGN_MAX..REALIGN_MIN tokens occur in the prediction (the first occurrence after the
    last aligned place, else the first anywhere), as an edit rejoins the text it edits. Failing
    that, the output's last token alone places a guess at its first occurrence after the last
    aligned place (a paraphrase often rejoins at one word: "help before then, please" ->
    "assistance before the weekend, please"); guesses are their own draft source, so the
    policy learns their lower acceptance apart from the prediction's.

        predicted:  Our store will be closed on Monday for inventory . Orders placed ...
        output:     We  will  -> lost; " will" once, after the last aligned place (0) -> draft "be closed on ..."
    """

    REALIGN_MIN = 2
    REALIGN_MAX = 4
    sources = ("prediction", "prediction_guess")

    def __init__(self) -> None:
        self.cursors: dict[str, _PredictionCursor] = {}
        self.source = "prediction"

    def propose(self, seq: Sequence, k: int) -> list[int]:
        predicted = seq.request.prediction_token_ids
        self.source = "prediction"
        if not predicted:
            return []
        cursor = self.cursors.get(seq.seq_id)
        if cursor is None:
            cursor = self.cursors[seq.seq_id] = _PredictionCursor()
        tokens, num_output = seq.token_ids, seq.num_output_tokens  # no copy of the output per step
        for token_id in tokens[seq.num_prompt_tokens + cursor.num_checked :]:
            if cursor.position is not None and cursor.position < len(predicted) and predicted[cursor.position] == token_id:
                cursor.position += 1
                cursor.last_aligned = cursor.position
            else:
                cursor.position = None
        cursor.num_checked = num_output
        if cursor.position is not None:
            return list(predicted[cursor.position : cursor.position + k])
        cursor.position = self._realign(cursor, predicted, tokens, num_output)
        if cursor.position is not None:
            return list(predicted[cursor.position : cursor.position + k])
        guess = self._guess(cursor, predicted, tokens, num_output)
        if guess is None:
            return []
        self.source = "prediction_guess"  # the cursor stays lost: the next step checks the guess's outcome afresh
        return list(predicted[guess : guess + k])

    def _follow(self, cursor: _PredictionCursor, predicted: list[int]) -> dict[tuple[int, ...], list[int]]:
        """n-gram (n = 1..REALIGN_MAX) -> the positions right after it, ascending; built once per sequence."""
        if cursor.follow is None:  # realigning then costs a lookup per n, not a scan
            cursor.follow = {}
            for n in range(1, self.REALIGN_MAX + 1):
                for end in range(n, len(predicted) + 1):
                    cursor.follow.setdefault(tuple(predicted[end - n : end]), []).append(end)
        return cursor.follow

    def _realign(self, cursor: _PredictionCursor, predicted: list[int], tokens: list[int], num_output: int) -> int | None:
        """Where the output's last n tokens (n = REALIGN_MAX..REALIGN_MIN, all output) occur in the prediction."""
        follow = self._follow(cursor, predicted)
        for n in range(min(self.REALIGN_MAX, num_output), self.REALIGN_MIN - 1, -1):
            found = follow.get(tuple(tokens[-n:]))
            if found:
                return next((end for end in found if end >= cursor.last_aligned), found[0])
        return None

    def _guess(self, cursor: _PredictionCursor, predicted: list[int], tokens: list[int], num_output: int) -> int | None:
        """Where the output's last token first occurs in the prediction after the last aligned place; None if not."""
        if num_output == 0:
            return None
        found = self._follow(cursor, predicted).get((tokens[-1],), ())
        return next((end for end in found if end > cursor.last_aligned), None)

    def forget(self, seq: Sequence) -> None:
        self.cursors.pop(seq.seq_id, None)


def _ngram(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _suffix(config: SpeculativeConfig) -> Proposer:
    return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob, config.num_speculative_tokens)


# speculative_config.method -> the proposer made from the config alone; "draft_model" holds a model and its
# pages, so the engine makes it (runtime/speculative/draft_model.py) and hands it to the Speculator
PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {"ngram": _ngram, "suffix": _suffix}
