r"""Prompt lookup: the last n tokens seen earlier propose what followed them then.

    tokens:  ... the cat sat on the mat . the cat | sat? on? the? mat?
                     \_____/ earlier occurrence      \___ drafts (k = 4)
             suffix "the cat" (n = 2) -> what followed its latest earlier occurrence

`NgramIndex` maps each n-gram (n in [n_min, n_max]) to the position after its latest
occurrence, updated as tokens arrive (O(n_max - n_min + 1) per token, never a scan). The
longest suffix with an earlier occurrence wins. A draft that runs past the end of the known
tokens continues from its own drafts, so a repeating pattern drafts its whole period.
"""

from __future__ import annotations


class NgramIndex:
    """n-gram -> the position right after its latest occurrence, over one growing token list."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {n_min}, {n_max}")
        self.n_min = n_min
        self.n_max = n_max
        self.num_indexed = 0  # tokens[:num_indexed] are indexed: every n-gram ending before position num_indexed - 1
        self.follow: dict[tuple[int, ...], int] = {}

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that now have a following token (the current suffix stays out: it is the query)."""
        for end in range(max(self.num_indexed, 1), len(tokens)):  # end: the position after the n-gram
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.follow[tuple(tokens[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tokens` seen earlier ([] if none)."""
        return self.propose_matched(tokens, k)[0]

    def propose_matched(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(drafts, the matched suffix's length n); ([], 0) if no suffix was seen before."""
        self.update(tokens)
        length = len(tokens)
        for n in range(min(self.n_max, length), self.n_min - 1, -1):
            start = self.follow.get(tuple(tokens[length - n :]))
            if start is None:
                continue
            drafts: list[int] = []
            for j in range(k):
                at = start + j
                drafts.append(tokens[at] if at < length else drafts[at - length])
            return drafts, n
        return [], 0
