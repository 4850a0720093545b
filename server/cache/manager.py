"""CacheManager: the single owner of KV memory (pool + request table + radix tree).

The radix cache and running requests share one pool: there is no separate cache budget. A slot
is always in exactly one of three places: the pool's free list, the tree (evictable when
unlocked, protected when locked), or a request's *private* range. ``check_invariants`` asserts

    free + evictable + protected + private == capacity, and no slot is owned twice.

Token ranges of a request with a table row (positions in ``fill_ids = input_ids + output_ids``):

    [0, prefix_len)            tree slots, locked through ``req.cache_node``
    [prefix_len, computed_len) private slots with computed KV
    [computed_len, alloc_len)  private slots allocated for the batch in flight (KV not yet valid)

On release (finish, abort, error, retract; one idempotent path) with caching on, the tree gets
``fill_ids[:computed_len]`` — only KV that was actually computed. Where the tree already had some
of those tokens (another request inserted them meanwhile), our private slots for them are
duplicates and are freed; ``[computed_len, alloc_len)`` is always freed. Then the lock is dropped
and the row returned. Without caching, every private slot is freed.

An unfinished request (chunked prefill) is cached the same way but keeps its row: its row is
rewritten with the tree's slots and its lock moves to the new, deeper node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.radix_tree import RadixCache
from server.cache.req_table import ReqToTokenTable

if TYPE_CHECKING:
    from server.scheduler.request import Req


@dataclass(frozen=True)
class PrefixHit:
    """What admission reused: ``cached_len`` leading tokens whose KV came from the tree."""

    cached_len: int


@dataclass
class CacheStats:
    evicted_tokens: int = 0


class CacheManager:
    """Args: pool, req_table, tree (a disabled RadixCache for ``--disable-radix-cache``)."""

    def __init__(self, pool: TokenKVPool, req_table: ReqToTokenTable, tree: RadixCache):
        self.pool = pool
        self.req_table = req_table
        self.tree = tree
        self.stats = CacheStats()

    # ------------------------------------------------------------------ sizes
    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.pool.num_free + self.tree.evictable_size

    def prefix_len(self, req: "Req") -> int:
        """Read-only length of the cached prefix admission would reuse (for policies)."""
        return min(self.tree.prefix_len(req.fill_ids, req.namespace)[0], self.max_prefix(req))

    @staticmethod
    def max_prefix(req: "Req") -> int:
        """Longest reusable prefix: at least one token is computed (for the logits), and prompt
        positions whose logprobs are wanted must be computed too."""
        cap = req.fill_len - 1
        if req.wants_input_logprobs:
            first = req.logprobs.logprob_start_len + len(req.input_token_logprobs) - 1
            cap = min(cap, max(first, 0))
        return max(cap, 0)

    # ------------------------------------------------------------------ admission
    def admit(self, req: "Req") -> PrefixHit:
        """Match and lock the request's cached prefix and give it a table row holding it.

        Raises NoFreeRowError (nothing changed) when no row is free.
        """
        row = self.req_table.alloc_row()
        hit = self.tree.match_prefix(req.fill_ids[:self.max_prefix(req)], req.namespace)
        self.tree.inc_lock_ref(hit.node)
        self.req_table.write(row, 0, hit.slots)
        req.row, req.cache_node = row, hit.node
        req.prefix_len = req.computed_len = req.alloc_len = hit.length
        return PrefixHit(hit.length)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` slots, evicting LRU cache leaves if the free list is short; None (and
        nothing taken) when even eviction cannot make room."""
        if n > self.available:
            return None
        short = n - self.pool.num_free
        if short > 0:
            freed = self.tree.evict(short)
            self.stats.evicted_tokens += freed.numel()
            self.pool.free(freed)
        return self.pool.alloc(n)

    def extend_row(self, req: "Req", slots: torch.Tensor) -> None:
        """Record freshly allocated slots for positions [alloc_len, alloc_len + len(slots))."""
        self.req_table.write(req.row, req.alloc_len, slots)
        req.alloc_len += slots.numel()

    def extend_rows_by_one(self, reqs: list["Req"], slots: torch.Tensor) -> None:
        """:meth:`extend_row` with one slot for each request (a decode step), in one table
        write. slots: [len(reqs)] int64."""
        self.req_table.write_one_each([r.row for r in reqs], [r.alloc_len for r in reqs], slots)
        for r in reqs:
            r.alloc_len += 1

    def truncate_alloc(self, req: "Req") -> None:
        """Free the slots of positions [computed_len, alloc_len) (e.g. rejected drafts)."""
        if req.alloc_len > req.computed_len:
            self.pool.free(self.req_table.read(req.row, req.computed_len, req.alloc_len).clone())
            req.alloc_len = req.computed_len

    # ------------------------------------------------------------------ caching and release
    def cache_unfinished(self, req: "Req") -> None:
        """Insert the computed prefix of a still-running request; it keeps its row and work."""
        if self.tree.disabled or req.row is None or req.computed_len <= req.prefix_len:
            return
        node = self._insert_computed(req)
        slots = self.tree.match_prefix(req.fill_ids[:req.computed_len], req.namespace)
        self.req_table.write(req.row, 0, slots.slots)
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.cache_node)
        req.cache_node, req.prefix_len = node, req.computed_len

    def release(self, req: "Req", cache: bool = True) -> None:
        """The one release path (finish, abort, error, retract). Idempotent."""
        if req.row is None:
            return
        row = req.row
        if req.alloc_len > req.computed_len:  # uncomputed slots of a batch in flight
            self.pool.free(self.req_table.read(row, req.computed_len, req.alloc_len).clone())
        if cache and not self.tree.disabled and req.computed_len > req.prefix_len:
            self._insert_computed(req)
        else:
            self.pool.free(self.req_table.read(row, req.prefix_len, req.computed_len).clone())
        self.tree.dec_lock_ref(req.cache_node)
        self.req_table.free_row(row)
        req.row, req.cache_node = None, None
        req.prefix_len = req.computed_len = req.alloc_len = 0

    def _insert_computed(self, req: "Req"):
        """Insert fill_ids[:computed_len]; free our duplicates of what the tree already had.

        Private slots are never in the tree (``cache_unfinished`` moves ``prefix_len`` past what
        it inserts), so every slot of ours in [prefix_len, existing_len) is a duplicate."""
        ours = self.req_table.read(req.row, 0, req.computed_len)
        result = self.tree.insert(req.fill_ids[:req.computed_len], ours, req.namespace)
        if result.existing_len > req.prefix_len:
            self.pool.free(ours[req.prefix_len:result.existing_len].clone())
        return result.node

    def flush(self, active: Iterable["Req"]) -> bool:
        """Drop the whole cache if no request holds memory; False (nothing done) otherwise."""
        if any(r.row is not None for r in active):
            return False
        self.pool.free(self.tree.all_slots())
        self.tree.reset()
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self, active: Iterable["Req"]) -> None:
        """AssertionError unless free + evictable + protected + private == capacity, every slot
        has one owner, and the tree's size counters match its contents."""
        reqs = [r for r in active if r.row is not None]
        private = [self.req_table.read(r.row, r.prefix_len, r.alloc_len) for r in reqs]
        n_private = sum(p.numel() for p in private)
        tree = self.tree
        assert tree.total_size == tree.evictable_size + tree.protected_size, "tree size counters"
        total = self.pool.num_free + tree.evictable_size + tree.protected_size + n_private
        assert total == self.pool.capacity, (
            f"free {self.pool.num_free} + evictable {tree.evictable_size} + protected "
            f"{tree.protected_size} + private {n_private} = {total} != {self.pool.capacity}")
        everything = torch.cat([tree.all_slots(), self.pool._free, *private])
        assert everything.unique().numel() == everything.numel(), "a KV slot is owned twice"
        for r in reqs:  # a request's prefix rows are exactly the tree's slots for its key
            m = tree.prefix_len(r.fill_ids[:r.prefix_len], r.namespace)[0]
            assert m >= r.prefix_len or tree.disabled, f"{r.rid}: locked prefix not in tree"
