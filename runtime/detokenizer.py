"""Incremental detokenization that never emits half a character, with stop strings.

Byte-fallback tokenizers split a multi-byte character across tokens; decoding a prefix
then ends in U+FFFD. We decode a short window of recent tokens twice (with and without
the newest ones) and emit the difference only once it no longer ends in U+FFFD. Decoding a
window rather than single tokens keeps tokenizers' spacing rules (a leading "▁" becomes a
space only after other text) right.

Each output token's share of the text is kept too (`take_token_texts`), so logprob tokens
spell the text exactly.

Stop strings: the text that could still be the start of a stop string is held back from
`new_text` until it is known not to be; a found stop string ends the sequence and is cut
from the text (unless include_stop_str_in_output).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

NUM_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first output token, for spacing


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always whole characters."""

    def __init__(
        self,
        tokenizer: Decoder | None,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop_str = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.context_ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.context_ids)
        self.text = ""
        self.num_emitted_chars = 0
        self.token_ends: list[int] = []  # per output token: len(text) once it was added (clamped on reading)
        self.num_released_tokens = 0

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer at the same point (for a forked sample)."""
        twin = object.__new__(IncrementalDetokenizer)
        twin.__dict__.update(self.__dict__)
        twin.context_ids = list(self.context_ids)
        twin.token_ends = list(self.token_ends)
        return twin

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; return the stop string it completed, if any (none looked for without `check_stop`)."""
        stop = self._append(token_id, check_stop)
        self.token_ends.append(len(self.text))
        return stop

    def append_silent(self) -> None:
        """An output token that adds no text (a stop token id, EOS): it still gets its (empty) place."""
        self.token_ends.append(len(self.text))

    def _append(self, token_id: int, check_stop: bool = True) -> str | None:
        if self.tokenizer is None:
            return None
        self.context_ids.append(token_id)
        before = self._decode(self.context_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.context_ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None
        delta = after[len(before) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.context_ids)
        if self.prefix_offset > 4 * NUM_CONTEXT_TOKENS:  # keep the decoded window short
            drop = self.prefix_offset
            self.context_ids = self.context_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return self._append_text(delta, check_stop)

    def _append_text(self, delta: str, check_stop: bool = True) -> str | None:
        """Append; if a stop string now appears, cut at the earliest one and return it."""
        search_from = max(0, len(self.text) - self.hold_back)
        self.text += delta
        if not check_stop:
            return None
        found = [(at, stop) for stop in self.stop if (at := self.text.find(stop, search_from)) != -1]
        if not found:
            return None
        at, stop = min(found, key=lambda hit: (hit[0], -len(hit[1])))
        self.text = self.text[: at + len(stop)] if self.include_stop_str else self.text[:at]
        return stop

    def flush(self) -> str | None:
        """At the end: keep whatever bytes are still pending, even if incomplete.

        Returns the stop string that the flushed text completed, if any.
        """
        if self.tokenizer is None or self.read_offset == len(self.context_ids):
            return None
        before = self._decode(self.context_ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.context_ids[self.prefix_offset :])
        self.read_offset = len(self.context_ids)
        stop = self._append_text(after[len(before) :]) if len(after) > len(before) else None
        if self.token_ends:
            self.token_ends[-1] = len(self.text)  # the held bytes end with the last token
        return stop

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, the tail that may begin a stop string waits."""
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.hold_back)
        new_text = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return new_text

    def take_token_texts(self, finished: bool) -> list[tuple[int, str]]:
        """(output index, text) of each token whose text is now all handed out, in order, once each.

        A token's text is what it added to `text` (a split character belongs to the token that
        completes it; a stop string's cut shortens the last ones), so the texts of all tokens,
        joined, are `text`. Call after take_new_text.
        """
        ends, num_chars = self.token_ends, len(self.text)
        texts = []
        while self.num_released_tokens < len(ends):
            i = self.num_released_tokens
            end = min(ends[i], num_chars)
            if not finished and end > self.num_emitted_chars:
                break
            start = min(ends[i - 1], num_chars) if i else 0
            texts.append((i, self.text[start:end]))
            self.num_released_tokens += 1
        return texts

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
