"""RadixCache: the KV cache as a radix tree over token ids (RadixAttention, SGLang paper §3).

Keys are ``(namespace, token ids)``; each edge holds a run of tokens and the KV pool slots that
hold their K/V (value[i] is the slot of key[i]). Every namespace (model/weights version, cache
salt) has its own root, so equal tokens under different namespaces never share KV.

Ownership: slots stored in the tree belong to the tree. A running request *locks* the path it
uses (``inc_lock_ref``); locked nodes are never evicted. Unlocked nodes are *evictable*; eviction
removes unlocked leaves in LRU order (a parent becomes a leaf, and a candidate, once its last
child goes), so shared ancestors outlive their branches.

The tree never touches the pool: :meth:`evict` returns the slots it dropped, and :meth:`insert`
tells the caller which of the caller's slots it kept, so it can be built, printed and fuzzed
without a model or tensors on a device. LRU order uses a logical clock, so it is deterministic.

Reference implementation of the idea: sglang ``srt/mem_cache/radix_cache.py``.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """An edge (``key`` tokens, ``value`` slots) and the node it leads to."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access", "id")
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None"):
        self.key = key
        self.value = value
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(TreeNode._ids)

    @property
    def is_root(self) -> bool:
        """True for a namespace's root (no parent, no key)."""
        return self.parent is None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """slots: [length] int64 KV slots of the matched prefix, valid only while ``node`` is locked
    (or until the next evict); node: the handle to lock/unlock (the root when length == 0)."""

    slots: torch.Tensor
    node: TreeNode
    length: int


@dataclass(frozen=True)
class InsertResult:
    """existing_len: leading tokens that were already in the tree (their slots stay the tree's;
    the caller's slots for them are duplicates the caller must free, except where they are the
    very same slots). node: the node ending at the inserted key (lock it to keep it)."""

    existing_len: int
    node: TreeNode


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists (C-speed slice compare on the fast path)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache:
    """A radix tree of token ids -> KV slots with lock counts and LRU eviction.

    Args:
        disabled: a tree that never matches and never stores (``--disable-radix-cache``): the
            callers run the same code path without reuse.
    """

    def __init__(self, disabled: bool = False):
        self.disabled = disabled
        # called with each leaf :meth:`evict` is about to drop (still attached: see
        # :meth:`path`), e.g. to copy its KV into a lower tier (server.cache.tiers)
        self.on_evict: Callable[[TreeNode], None] | None = None
        self.reset()

    def reset(self) -> None:
        """Drop every node. The caller must have freed (or be about to free) all tree slots
        (see :meth:`all_slots`) and no node may be locked."""
        self._roots: dict[Hashable, TreeNode] = {}
        self._namespace_of: dict[int, Hashable] = {}  # id(root) -> namespace
        self._clock = itertools.count(1)
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    def _root(self, namespace: Hashable, create: bool) -> TreeNode | None:
        root = self._roots.get(namespace)
        if root is None and create:
            root = self._roots[namespace] = TreeNode([], _EMPTY, None)
            root.lock_ref = 1  # roots are never evicted
            self._namespace_of[id(root)] = namespace
        return root

    # ------------------------------------------------------------------ lookups
    def match_prefix(self, key: Sequence[int], namespace: Hashable = None) -> MatchResult:
        """Longest cached prefix of ``key``.

        Mutates the tree: splits the edge where the match ends inside it (so the returned node
        ends exactly at the match) and marks the path as recently used. Does not lock.
        """
        root = self._root(namespace, create=not self.disabled)
        if self.disabled or root is None:
            return MatchResult(_EMPTY, root or TreeNode([], _EMPTY, None), 0)
        node, values, pos, now = root, [], 0, next(self._clock)
        key = list(key)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + k
            if k < len(child.key):
                break
        slots = torch.cat(values) if values else _EMPTY
        return MatchResult(slots, node, pos)

    def prefix_len(self, key: Sequence[int], namespace: Hashable = None) -> tuple[int, TreeNode | None]:
        """Read-only: length of the longest cached prefix and the deepest node whose whole path
        is inside it (None when nothing matches). No split, no LRU update (for policies)."""
        root = None if self.disabled else self._root(namespace, create=False)
        if root is None:
            return 0, None
        node, pos, deepest = root, 0, None
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, key[pos:pos + len(child.key)])
            pos += k
            if k < len(child.key):
                break
            node = deepest = child
        return pos, deepest

    # ------------------------------------------------------------------ updates
    def insert(self, key: Sequence[int], slots: torch.Tensor,
               namespace: Hashable = None) -> InsertResult:
        """Store ``key`` -> ``slots`` ([len(key)] int64). The tree takes ownership of the slots
        for positions [existing_len, len(key)); for [0, existing_len) it keeps its own.
        A disabled tree stores nothing and reports existing_len == 0 and the (detached) root."""
        if self.disabled:
            return InsertResult(0, self._root(namespace, create=False) or TreeNode([], _EMPTY, None))
        root = self._root(namespace, create=True)
        node, pos, now = root, 0, next(self._clock)
        key = list(key)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                leaf = TreeNode(key[pos:], slots[pos:].clone(), node)
                leaf.last_access = now
                node.children[key[pos]] = leaf
                self.evictable_size += len(leaf.key)
                return InsertResult(pos, leaf)
            k = common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            node, pos = child, pos + k
        return InsertResult(pos, node)

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut ``child``'s edge after k tokens; returns the new upper node (same lock count)."""
        upper = TreeNode(child.key[:k], child.value[:k].clone(), child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children[child.key[k]] = child
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key, child.value = child.key[k:], child.value[k:].clone()
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path root..node (each node's count +1): none of it can be evicted."""
        while node is not None and not node.is_root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref` on the same node. Raises AssertionError on underflow."""
        while node is not None and not node.is_root:
            assert node.lock_ref > 0, f"lock underflow at {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Remove unlocked leaves, least recently used first, until at least ``num_tokens``
        tokens are gone or nothing evictable is left. Whole nodes go, so it may free more than
        asked; ``evict(0)`` does nothing. Returns the freed slots ([n] int64) for the caller to
        return to the pool."""
        if num_tokens <= 0 or self.evictable_size == 0:
            return _EMPTY
        heap = [(n.last_access, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while heap and count < num_tokens:
            _, _, node = heapq.heappop(heap)
            if self.on_evict is not None:
                self.on_evict(node)
            parent = node.parent
            del parent.children[node.key[0]]
            freed.append(node.value)
            count += len(node.key)
            self.evictable_size -= len(node.key)
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return torch.cat(freed)

    # ------------------------------------------------------------------ inspection
    def path(self, node: TreeNode) -> tuple[Hashable, list[int], torch.Tensor]:
        """(namespace, token ids, slots [len] int64) from the root to the end of ``node``."""
        keys, values = [], []
        while not node.is_root:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        key = [t for k in reversed(keys) for t in k]
        slots = torch.cat(values[::-1]) if values else _EMPTY
        return self._namespace_of.get(id(node)), key, slots

    def nodes(self) -> list[TreeNode]:
        """Every node but the roots."""
        return list(self._nodes())

    def leaves(self) -> list[TreeNode]:
        """Every node without children (the ends of all cached sequences)."""
        return [n for n in self._nodes() if not n.children]

    def _nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    @property
    def total_size(self) -> int:
        """Tokens stored (== evictable_size + protected_size)."""
        return sum(len(n.key) for n in self._nodes())

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree owns ([total_size] int64, any order)."""
        values = [n.value for n in self._nodes()]
        return torch.cat(values) if values else _EMPTY

    def pretty_print(self) -> str:
        """One line per node: indentation = depth, then tokens (first 8), length, lock, time."""
        lines = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.key[0]):
                head = " ".join(map(str, child.key[:8])) + (" …" if len(child.key) > 8 else "")
                lines.append(f"{'  ' * depth}[{head}] len={len(child.key)} "
                             f"lock={child.lock_ref} t={child.last_access}")
                walk(child, depth + 1)

        for ns, root in self._roots.items():
            lines.append(f"namespace {ns!r}:")
            walk(root, 1)
        lines.append(f"evictable={self.evictable_size} protected={self.protected_size}")
        return "\n".join(lines)


if __name__ == "__main__":  # a tiny demo: python -m server.cache.radix_tree
    tree = RadixCache()
    tree.insert([1, 2, 3, 4, 5], torch.arange(10, 15))
    tree.insert([1, 2, 3, 9], torch.arange(20, 24))
    hit = tree.match_prefix([1, 2, 3, 4, 7])
    tree.inc_lock_ref(hit.node)
    print(tree.pretty_print())
    print("matched", hit.length, "slots", hit.slots.tolist())
    print("evict(1) ->", tree.evict(1).tolist())
    print(tree.pretty_print())
