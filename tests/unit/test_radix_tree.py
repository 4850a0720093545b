"""RadixCache: exact behaviour (splits, eviction order, lock counts) and a hypothesis stateful
differential test against a naive reference (a dict from every stored prefix to its slot)."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from server.cache.radix_tree import RadixCache, common_prefix_len


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def edges(tree: RadixCache, ns=None) -> list[list[int]]:
    """Edge keys in DFS order (children by first token)."""
    out = []

    def walk(node):
        for c in sorted(node.children.values(), key=lambda n: n.key[0]):
            out.append(list(c.key))
            walk(c)

    walk(tree._roots[ns])
    return out


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len(list(range(1000)), list(range(999)) + [7]) == 999


def test_insert_and_match_split_edges():
    tree = RadixCache()
    assert tree.insert([1, 2, 3, 4], t(10, 11, 12, 13)).existing_len == 0
    r = tree.insert([1, 2, 5], t(20, 21, 22))
    assert r.existing_len == 2 and list(r.node.key) == [5]
    assert edges(tree) == [[1, 2], [3, 4], [5]]
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == [10, 11, 12]
    assert edges(tree) == [[1, 2], [3], [4], [5]]  # the match split [3, 4]
    assert tree.evictable_size == 5 and tree.total_size == 5


def test_full_repeat_and_empty_keys():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3))
    r = tree.insert([1, 2, 3], t(7, 8, 9))
    assert r.existing_len == 3 and tree.total_size == 3
    assert tree.match_prefix([]).length == 0
    assert tree.match_prefix([4]).length == 0


def test_namespaces_never_share():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3), namespace="a")
    assert tree.match_prefix([1, 2, 3], namespace="b").length == 0
    assert tree.match_prefix([1, 2, 3], namespace="a").length == 3
    assert tree.insert([1, 2, 3], t(4, 5, 6), namespace="b").existing_len == 0
    assert tree.total_size == 6


def test_lru_eviction_order_is_exact_and_leaves_first():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3))      # time 1
    tree.insert([1, 2, 4, 5], t(1, 2, 4, 5))  # time 2: splits [1,2] | [3], [4,5]
    tree.insert([7, 8], t(7, 8))            # time 3
    tree.match_prefix([1, 2, 3])            # time 4: touches [1,2] and [3]
    # leaves by last access: [4,5] (t2), [7,8] (t3), [3] (t4); [1,2] only once a leaf
    assert tree.evict(1).tolist() == [4, 5]
    assert tree.evict(2).tolist() == [7, 8]
    assert tree.evict(1).tolist() == [3]
    assert tree.evict(1).tolist() == [1, 2]  # the parent became a leaf
    assert tree.total_size == tree.evictable_size == 0
    assert tree.evict(5).numel() == 0 and tree.evict(0).numel() == 0


def test_locked_paths_are_never_evicted_and_counts_are_exact():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3))
    tree.insert([1, 2, 9], t(1, 2, 9))
    m = tree.match_prefix([1, 2, 3])
    tree.inc_lock_ref(m.node)
    tree.inc_lock_ref(m.node)
    assert m.node.lock_ref == 2 and m.node.parent.lock_ref == 2
    assert tree.protected_size == 3 and tree.evictable_size == 1
    assert tree.evict(100).tolist() == [9]  # only the unlocked branch
    tree.dec_lock_ref(m.node)
    assert tree.protected_size == 3
    tree.dec_lock_ref(m.node)
    assert tree.protected_size == 0 and tree.evictable_size == 3
    assert sorted(tree.evict(100).tolist()) == [1, 2, 3]


def test_split_keeps_lock_counts_consistent():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], t(1, 2, 3, 4))
    m = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(m.node)
    tree.match_prefix([1, 2, 7])  # splits the locked edge
    assert edges(tree) == [[1, 2], [3, 4]]
    assert all(n.lock_ref == 1 for n in tree._nodes())
    tree.dec_lock_ref(m.node)  # the old handle still unlocks the whole path
    assert tree.protected_size == 0 and tree.evictable_size == 4


def test_disabled_tree_stores_nothing():
    tree = RadixCache(disabled=True)
    r = tree.insert([1, 2], t(1, 2))
    assert r.existing_len == 0 and tree.total_size == 0
    m = tree.match_prefix([1, 2])
    assert m.length == 0
    tree.inc_lock_ref(m.node)
    tree.dec_lock_ref(m.node)
    assert tree.prefix_len([1, 2]) == (0, None)


def test_prefix_len_is_read_only():
    tree = RadixCache()
    tree.insert([1, 2, 3, 4], t(1, 2, 3, 4))
    n, node = tree.prefix_len([1, 2, 3, 9])
    assert n == 3 and node is None  # no node ends inside the edge, and no split happened
    assert edges(tree) == [[1, 2, 3, 4]]
    assert tree.prefix_len([1, 2, 3, 4, 5])[0] == 4


def test_pretty_print():
    tree = RadixCache()
    tree.insert([1, 2, 3], t(1, 2, 3))
    tree.insert([1, 5], t(1, 5))
    text = tree.pretty_print()
    assert "[1] len=1" in text and "[2 3] len=2" in text and "evictable=4" in text


class RadixTreeMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks and evictions against a naive reference."""

    keys = st.lists(st.integers(0, 3), min_size=0, max_size=8)
    namespaces = st.sampled_from([None, "salt"])

    @initialize()
    def setup(self):
        self.tree = RadixCache()
        self.ref: dict[tuple, int] = {}  # (ns, *prefix) -> slot of the prefix's last token
        self.next_slot = 1
        self.locks: list[tuple] = []  # (node, ns, key) of held locks

    def ref_match(self, ns, key):
        m = 0
        while m < len(key) and (ns, *key[:m + 1]) in self.ref:
            m += 1
        return m

    @rule(key=keys, ns=namespaces)
    def insert(self, key, ns):
        slots = torch.arange(self.next_slot, self.next_slot + len(key))
        self.next_slot += len(key)
        expected = self.ref_match(ns, key)
        r = self.tree.insert(key, slots, ns)
        assert r.existing_len == expected
        for i in range(expected, len(key)):
            self.ref[(ns, *key[:i + 1])] = int(slots[i])

    @rule(key=keys, ns=namespaces)
    def match(self, key, ns):
        m = self.tree.match_prefix(key, ns)
        n = self.ref_match(ns, key)
        assert m.length == n
        assert m.slots.tolist() == [self.ref[(ns, *key[:i + 1])] for i in range(n)]

    @rule(key=keys, ns=namespaces)
    def lock(self, key, ns):
        m = self.tree.match_prefix(key, ns)
        self.tree.inc_lock_ref(m.node)
        self.locks.append((m.node, ns, tuple(key[:m.length])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.tree.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        before = self.tree.evictable_size
        freed = set(self.tree.evict(n).tolist())
        assert len(freed) >= min(n, before)
        locked = {(ns, *key[:i + 1]) for _, ns, key in self.locks for i in range(len(key))}
        gone = {p for p, s in self.ref.items() if s in freed}
        assert len(gone) == len(freed) and not gone & locked, "evicted a locked prefix"
        for p in gone:
            del self.ref[p]
        # leaves first: what remains is still closed under taking prefixes
        assert all((p[0], *p[1:-1]) in self.ref for p in self.ref if len(p) > 2)

    @invariant()
    def sizes_and_ownership(self):
        tree = self.tree
        slots = tree.all_slots().tolist()
        assert sorted(slots) == sorted(self.ref.values()) and len(set(slots)) == len(slots)
        assert tree.total_size == len(self.ref) == tree.evictable_size + tree.protected_size
        locked = {(ns, *key[:i + 1]) for _, ns, key in self.locks for i in range(len(key))}
        assert tree.protected_size == len(locked)


TestRadixTreeStateful = RadixTreeMachine.TestCase
TestRadixTreeStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
