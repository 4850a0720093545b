"""The router's approximate radix tree (SGLang paper, Appendix A.4 "cache-aware load balancing":
the router keeps, per worker, the prefixes it sent there and matches new requests against them).

Keys are request texts (characters; the router needs no tokenizer): a chat request is keyed by
its messages rendered in order. Each worker's tree holds at most ``capacity`` characters,
mirroring the worker's KV pool (its ``max_total_tokens`` times an average of characters per
token); beyond that the least recently used leaves are evicted, as the worker's own radix cache
evicts its least recently used leaves.
"""

from __future__ import annotations

import heapq
import itertools
import time


class _Node:
    __slots__ = ("children", "parent", "key", "last_access")

    def __init__(self, parent: "_Node | None", key: str):
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.key = key
        self.last_access = time.monotonic()


class PrefixTree:
    """Text prefixes sent to one worker.

    Args:
        capacity: characters kept before LRU eviction (>= 1).
    """

    def __init__(self, capacity: int):
        self.root = _Node(None, "")
        self.capacity = max(1, capacity)
        self.size = 0  # characters stored
        self._tick = itertools.count()

    def match(self, text: str) -> int:
        """Length in characters of the longest stored prefix of ``text``."""
        node, pos = self.root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            n = _common(child.key, text, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, text: str) -> None:
        """Record ``text`` as sent (touching its path), then evict down to capacity."""
        node, pos, now = self.root, 0, time.monotonic()
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                leaf = _Node(node, text[pos:])
                node.children[text[pos]] = leaf
                leaf.last_access = now
                self.size += len(leaf.key)
                break
            n = _common(child.key, text, pos)
            if n < len(child.key):  # split the edge at the divergence point
                mid = _Node(node, child.key[:n])
                node.children[text[pos]] = mid
                child.key = child.key[n:]
                child.parent = mid
                mid.children[child.key[0]] = child
                child = mid
            child.last_access = now
            node, pos = child, pos + n
        self._evict()

    def _evict(self) -> None:
        if self.size <= self.capacity:
            return
        leaves = [(n.last_access, next(self._tick), n) for n in self._nodes()
                  if not n.children and n is not self.root]
        heapq.heapify(leaves)
        while self.size > self.capacity and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, next(self._tick), parent))

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def _common(key: str, text: str, pos: int) -> int:
    n, limit = 0, min(len(key), len(text) - pos)
    while n < limit and key[n] == text[pos + n]:
        n += 1
    return n
