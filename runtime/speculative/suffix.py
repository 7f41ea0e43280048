r"""Suffix decoding's memory (Arctic Inference, arXiv 2411.04975): past answers, by cache scope.

Every finished answer is kept as a record: its output plus the last tokens of its prompt (so
a question asked again matches from its first output token). Each scope (a prefix-cache
salt: one tenant, or one tenant's client salt) has a depth-bounded trie over its records'
substrings, each node counting how often its path occurred:

    records "a b c", "a b d"          root
    (depth 3)                          ├ a:2 ─ b:2 ┬ c:1
                                       │           └ d:1
                                       ├ b:2 ┬ c:1
                                       │     └ d:1
                                       ├ c:1
                                       └ d:1

`propose(scope, context, k)` finds the longest suffix of the context that is a path, then
follows the most frequent child while the path's probability (child count / node count,
multiplied along the way) stays at or above `min_token_prob`; at most max_spec_factor × the
match length tokens. A scope's trie only ever sees its own scope's records, so one tenant's
answers never draft for another. The records are bounded (`max_cached_requests`, least
recently cached evicted first, its counts taken back out of its trie), so the memory is too:
at most max_cached_requests × (record length × max_depth) nodes.
"""

from __future__ import annotations

from collections import OrderedDict


class _Node:
    """A path in the trie: how often it occurred, and what followed it."""

    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] | None = None


class SuffixTrie:
    """Counted substrings (length <= max_depth) of a multiset of token records."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"the suffix trie's depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0

    def insert(self, tokens: list[int]) -> None:
        """Count every substring of `tokens` up to max_depth long (O(len × max_depth))."""
        for start in range(len(tokens)):
            node = self.root
            node.count += 1
            for token in tokens[start : start + self.max_depth]:
                if node.children is None:
                    node.children = {}
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += 1
                node = child

    def remove(self, tokens: list[int]) -> None:
        """Take back an earlier `insert(tokens)`; paths no record holds any more are dropped."""
        for start in range(len(tokens)):
            node = self.root
            node.count -= 1
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # nothing below it is held either (counts only fall going down)
                    del node.children[token]
                    self.num_nodes -= self._size(child)
                    break
                node = child

    @staticmethod
    def _size(node: _Node) -> int:
        size, stack = 0, [node]
        while stack:
            current = stack.pop()
            size += 1
            if current.children:
                stack.extend(current.children.values())
        return size

    def propose(self, context: list[int], k: int, max_match: int, max_spec_factor: float,
                min_token_prob: float, min_match: int = 1) -> tuple[list[int], int]:
        """(drafts, match length): continue the longest suffix of `context` (min_match..max_match) seen here.

        A suffix whose node has no likely-enough continuation gives way to the next shorter one.
        """
        length = len(context)
        for match in range(min(max_match, length, self.max_depth - 1), min_match - 1, -1):
            node = self.root
            for token in context[length - match :]:
                node = node.children.get(token) if node.children else None
                if node is None:
                    break
            if node is None:
                continue
            drafts: list[int] = []
            limit = min(k, max(1, int(max_spec_factor * match)), self.max_depth - match)
            probability = 1.0
            while len(drafts) < limit and node.children:
                token, child = max(node.children.items(), key=lambda item: item[1].count)
                probability *= child.count / node.count
                if probability < min_token_prob:
                    break
                drafts.append(token)
                node = child
            if drafts:
                return drafts, match
        return [], 0


class SuffixCache:
    """Past answers per cache scope, bounded by a count of records (least recently cached out first)."""

    def __init__(self, max_depth: int, max_cached_requests: int) -> None:
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.scopes: dict[bytes | None, SuffixTrie] = {}
        self.records: OrderedDict[int, tuple[bytes | None, list[int]]] = OrderedDict()
        self._next_record = 0

    def add(self, scope: bytes | None, tokens: list[int]) -> None:
        """Keep one answer (its tokens) in its scope; the oldest record goes when over the bound."""
        if self.max_cached_requests == 0 or not tokens:
            return
        trie = self.scopes.get(scope)
        if trie is None:
            trie = self.scopes[scope] = SuffixTrie(self.max_depth)
        trie.insert(tokens)
        self.records[self._next_record] = (scope, tokens)
        self._next_record += 1
        while len(self.records) > self.max_cached_requests:
            _, (old_scope, old_tokens) = self.records.popitem(last=False)
            old_trie = self.scopes[old_scope]
            old_trie.remove(old_tokens)
            if old_trie.root.count == 0:
                del self.scopes[old_scope]

    def trie(self, scope: bytes | None) -> SuffixTrie | None:
        """The scope's trie, or None when it holds no record."""
        return self.scopes.get(scope)

    @property
    def num_nodes(self) -> int:
        """Trie nodes held over all scopes (the memory the cache takes)."""
        return sum(trie.num_nodes for trie in self.scopes.values())
