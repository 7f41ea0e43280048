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

from array import array
from collections import OrderedDict


_STRIDE = 1 << 24  # child key = parent id * _STRIDE + token (vocabularies below 16M tokens)
_NONE = -1


class SuffixTrie:
    """Counted substrings (length <= max_depth) of a multiset of token records.

    Nodes are ids into flat integer arrays (count, token, first child, previous and next sibling)
    and one dict from (parent, token) to child: millions of nodes stay out of the garbage
    collector's way (as objects, 2M nodes cost a 1.3 s full collection in the engine thread).
    Node 0 is the root; freed ids are reused.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"the suffix trie's depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._child: dict[int, int] = {}  # parent * _STRIDE + token -> child id
        self._count = array("q", [0])  # [nodes]: times the node's path occurred
        self._token = array("q", [_NONE])  # [nodes]: the token that leads here from the parent
        self._first = array("q", [_NONE])  # [nodes]: one child (its siblings are linked)
        self._prev = array("q", [_NONE])  # [nodes]: siblings, doubly linked
        self._next = array("q", [_NONE])
        self._free: list[int] = []
        self.num_nodes = 0  # besides the root

    @property
    def root_count(self) -> int:
        """Substring walks counted at the root: the records' total length (0: the trie is empty)."""
        return self._count[0]

    def _new_child(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._count[node], self._token[node], self._first[node] = 0, token, _NONE
        else:
            node = len(self._count)
            for column, value in ((self._count, 0), (self._token, token), (self._first, _NONE),
                                  (self._prev, _NONE), (self._next, _NONE)):
                column.append(value)
        head = self._first[parent]
        self._prev[node], self._next[node] = _NONE, head
        if head != _NONE:
            self._prev[head] = node
        self._first[parent] = node
        self._child[parent * _STRIDE + token] = node
        self.num_nodes += 1
        return node

    def _drop_child(self, parent: int, node: int) -> None:
        prev, nxt = self._prev[node], self._next[node]
        if prev != _NONE:
            self._next[prev] = nxt
        else:
            self._first[parent] = nxt
        if nxt != _NONE:
            self._prev[nxt] = prev
        del self._child[parent * _STRIDE + self._token[node]]
        self._free.append(node)
        self.num_nodes -= 1

    def insert(self, tokens: list[int]) -> None:
        """Count every substring of `tokens` up to max_depth long (O(len × max_depth))."""
        child, count = self._child, self._count
        for start in range(len(tokens)):
            node = 0
            count[0] += 1
            for token in tokens[start : start + self.max_depth]:
                nxt = child.get(node * _STRIDE + token)
                if nxt is None:
                    nxt = self._new_child(node, token)
                count[nxt] += 1
                node = nxt

    def remove(self, tokens: list[int]) -> None:
        """Take back an earlier `insert(tokens)`; paths no record holds any more are dropped."""
        child, count = self._child, self._count
        for start in range(len(tokens)):
            node = 0
            count[0] -= 1
            for token in tokens[start : start + self.max_depth]:
                nxt = child[node * _STRIDE + token]
                count[nxt] -= 1
                if count[nxt] == 0:  # counts only fall going down: the rest of this walk goes too
                    self._drop_child(node, nxt)
                node = nxt

    def _children(self, node: int):
        child = self._first[node]
        while child != _NONE:
            yield child
            child = self._next[child]

    def propose(self, context: list[int], k: int, max_match: int, max_spec_factor: float,
                min_token_prob: float, min_match: int = 1) -> tuple[list[int], int]:
        """(drafts, match length): continue the longest suffix of `context` (min_match..max_match) seen here.

        A suffix whose node has no likely-enough continuation gives way to the next shorter one.
        """
        child, count = self._child, self._count
        length = len(context)
        for match in range(min(max_match, length, self.max_depth - 1), min_match - 1, -1):
            node = 0
            for token in context[length - match :]:
                node = child.get(node * _STRIDE + token, _NONE)
                if node == _NONE:
                    break
            if node == _NONE:
                continue
            drafts: list[int] = []
            limit = min(k, max(1, int(max_spec_factor * match)), self.max_depth - match)
            probability = 1.0
            while len(drafts) < limit and self._first[node] != _NONE:
                best = max(self._children(node), key=count.__getitem__)
                probability *= count[best] / count[node]
                if probability < min_token_prob:
                    break
                drafts.append(self._token[best])
                node = best
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
            if old_trie.root_count == 0:
                del self.scopes[old_scope]

    def trie(self, scope: bytes | None) -> SuffixTrie | None:
        """The scope's trie, or None when it holds no record."""
        return self.scopes.get(scope)

    @property
    def num_nodes(self) -> int:
        """Trie nodes held over all scopes (the memory the cache takes)."""
        return sum(trie.num_nodes for trie in self.scopes.values())
