"""CacheManager: the single owner of KV memory (pool + request table + radix tree).

The radix cache and running requests share one pool: there is no separate cache budget. A slot
is always in exactly one of three places: the pool's free list, the tree (evictable when
unlocked, protected when locked), or a request's *private* range. ``check_invariants`` asserts

    free + evictable + protected + private == capacity, and no slot is owned twice.

The memory a request holds is a :class:`ReqMemory` handle kept here, keyed by request id (the
scheduler never sees rows, nodes or the tree; it reads lengths through :meth:`alloc_len` and
:meth:`holds`). Token ranges of a request that holds memory (positions in
``fill_ids = input_ids + output_ids``; ``computed_len`` is the scheduler's, on the Req):

    [0, prefix_len)            tree slots, locked through the handle's ``node``
    [prefix_len, computed_len) private slots with computed KV
    [computed_len, alloc_len)  private slots allocated for the batch in flight (KV not yet valid)

On release (finish, abort, error, retract; one idempotent path) with caching on, the tree gets
``fill_ids[:computed_len]`` — only KV that was actually computed. Where the tree already had some
of those tokens (another request inserted them meanwhile), our private slots for them are
duplicates and are freed; ``[computed_len, alloc_len)`` is always freed. Then the lock is dropped
and the row returned. Without caching, every private slot is freed.

An unfinished request (chunked prefill) is cached the same way but keeps its row: its row is
rewritten with the tree's slots and its lock moves to the new, deeper node.

Tiers (optional, :mod:`server.cache.tiers`): a leaf the tree evicts has its full pages copied
into the host tier (and from there to disk); admission loads the pages that continue a request's
cached prefix back into the pool and inserts them, so they count as cached tokens. A disk page
is read ahead on a reader thread when the request arrives (:meth:`prefetch`); until then the
request waits in the queue (:meth:`ready`), never the scheduler step.

What the rest of the server reads: :meth:`usage` (a :class:`CacheUsage` snapshot, for metrics),
:meth:`match` (cached prefix length and an opaque node handle, for the ordering policies) and
:meth:`scratch_tree` (an empty tree of the same kind, for in-step sharing checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.radix_tree import MatchResult, RadixCache, TreeNode
from server.cache.req_table import ReqToTokenTable
from server.cache.tiers import PAGE_TOKENS, KVTiers, page_hashes

if TYPE_CHECKING:
    from server.scheduler.request import Req


@dataclass(frozen=True)
class PrefixHit:
    """What admission reused: ``cached_len`` leading tokens whose KV came from the tree."""

    cached_len: int


@dataclass
class CacheStats:
    """Counters of the cache manager, in tokens."""

    evicted_tokens: int = 0
    loaded_tokens: int = 0  # copied back into the pool from a tier


@dataclass
class ReqMemory:
    """What one request holds: its request-table ``row``, the locked tree ``node`` covering
    positions [0, prefix_len), and slots allocated up to ``alloc_len`` (tokens)."""

    row: int
    node: Any
    prefix_len: int
    alloc_len: int


@dataclass(frozen=True)
class CacheUsage:
    """A snapshot of KV memory in tokens: pool ``capacity`` and ``free`` slots, tree slots that
    are ``evictable`` (unlocked) or ``protected`` (locked by a request), and ``evicted`` tokens
    since start (or the last stats reset)."""

    capacity: int
    free: int
    evictable: int
    protected: int
    evicted: int
    loaded: int = 0  # tokens loaded back from the host or disk tier
    host_pages: int = 0
    disk_pages: int = 0

    @property
    def held(self) -> int:
        """Slots held by requests or locked cache entries."""
        return self.capacity - self.free - self.evictable


class CacheManager:
    """Args: pool, req_table, tree (a disabled RadixCache for ``--disable-radix-cache``),
    tiers: host/disk tiers under the tree, or None."""

    def __init__(self, pool: TokenKVPool, req_table: ReqToTokenTable, tree: RadixCache,
                 tiers: KVTiers | None = None):
        self.pool = pool
        self.req_table = req_table
        self.tree = tree
        self.stats = CacheStats()
        self._held: dict[str, ReqMemory] = {}
        self.tiers = tiers if tiers is not None and not tree.disabled and pool.k_buffers \
            else None
        self._prefetching: dict[str, Any] = {}  # rid -> future of a disk read-ahead
        if self.tiers is not None:
            tree.on_evict = self._spill

    # ------------------------------------------------------------------ what the scheduler reads
    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.pool.num_free + self.tree.evictable_size

    @property
    def capacity(self) -> int:
        """Usable KV slots of the pool (tokens)."""
        return self.pool.capacity

    @property
    def free_rows(self) -> int:
        """Request-table rows not held by a request."""
        return self.req_table.num_free_rows

    @property
    def req_to_token(self) -> torch.Tensor:
        """The request table [max_requests, max_context] int64 the attention backend reads."""
        return self.req_table.table

    @property
    def disabled(self) -> bool:
        """True under ``--disable-radix-cache`` (nothing is ever reused)."""
        return self.tree.disabled

    def usage(self) -> CacheUsage:
        """Where the pool's slots are now (free, evictable, protected) and the counters."""
        tree, tiers = self.tree, self.tiers
        return CacheUsage(self.pool.capacity, self.pool.num_free, tree.evictable_size,
                          tree.protected_size, self.stats.evicted_tokens,
                          self.stats.loaded_tokens,
                          len(tiers.host) if tiers is not None else 0,
                          len(tiers.disk) if tiers is not None and tiers.disk is not None
                          else 0)

    def holds(self, rid: str) -> bool:
        """Whether request ``rid`` holds a row (and KV memory)."""
        return rid in self._held

    def row(self, rid: str) -> int:
        """The request-table row of ``rid``; KeyError if it holds none."""
        return self._held[rid].row

    def alloc_len(self, rid: str) -> int:
        """Positions of ``rid`` with a KV slot (0 when it holds no memory)."""
        mem = self._held.get(rid)
        return mem.alloc_len if mem is not None else 0

    def match(self, req: "Req") -> tuple[int, Any]:
        """Read-only: (cached prefix length admission would reuse, deepest fully matched node or
        None); the node is an opaque handle with ``parent`` and ``children`` for the policies."""
        return self.tree.prefix_len(req.key_ids[:self.max_prefix(req)], req.namespace)

    def scratch_tree(self) -> RadixCache:
        """An empty tree for bookkeeping that must not touch the cache (in-step sharing)."""
        return RadixCache()

    @staticmethod
    def max_prefix(req: "Req") -> int:
        """Longest reusable prefix: at least one token is computed (for the logits), and prompt
        positions whose logprobs (or hidden states: mean pooling) are wanted must be computed
        too."""
        if req.pools_every_row:
            return 0
        cap = req.fill_len - 1
        if req.wants_input_logprobs:
            first = req.logprobs.logprob_start_len + len(req.input_token_logprobs) - 1
            cap = min(cap, max(first, 0))
        return max(cap, 0)

    # ------------------------------------------------------------------ admission
    def admit(self, req: "Req") -> PrefixHit:
        """Match and lock the request's cached prefix and give it a table row holding it; the
        caller sets ``req.computed_len`` to the returned ``cached_len``.

        Raises NoFreeRowError (nothing changed) when no row is free.
        """
        assert req.rid not in self._held, f"{req.rid} already holds memory"
        row = self.req_table.alloc_row()
        key = req.key_ids[:self.max_prefix(req)]
        hit = self.tree.match_prefix(key, req.namespace)
        if self.tiers is not None:
            hit = self._load_back(key, req.namespace, hit)
        self.tree.inc_lock_ref(hit.node)
        self.req_table.write(row, 0, hit.slots)
        self._held[req.rid] = ReqMemory(row, hit.node, hit.length, hit.length)
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
        mem = self._held[req.rid]
        self.req_table.write(mem.row, mem.alloc_len, slots)
        mem.alloc_len += slots.numel()

    def extend_rows_by_one(self, reqs: list["Req"], slots: torch.Tensor) -> None:
        """:meth:`extend_row` with one slot for each request (a decode step), in one table
        write. slots: [len(reqs)] int64."""
        mems = [self._held[r.rid] for r in reqs]
        self.req_table.write_one_each([m.row for m in mems], [m.alloc_len for m in mems], slots)
        for m in mems:
            m.alloc_len += 1

    def truncate_alloc(self, req: "Req") -> None:
        """Free the slots of positions [computed_len, alloc_len) (e.g. rejected drafts)."""
        mem = self._held[req.rid]
        if mem.alloc_len > req.computed_len:
            self.pool.free(self.req_table.read(mem.row, req.computed_len, mem.alloc_len).clone())
            mem.alloc_len = req.computed_len

    # ------------------------------------------------------------------ caching and release
    def cache_unfinished(self, req: "Req") -> None:
        """Insert the computed prefix of a still-running request; it keeps its row and work."""
        mem = self._held.get(req.rid)
        if self.tree.disabled or mem is None or req.computed_len <= mem.prefix_len:
            return
        node = self._insert_computed(req, mem)
        slots = self.tree.match_prefix(req.key_ids[:req.computed_len], req.namespace)
        self.req_table.write(mem.row, 0, slots.slots)
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(mem.node)
        mem.node, mem.prefix_len = node, req.computed_len

    def release(self, req: "Req", cache: bool = True) -> None:
        """The one release path (finish, abort, error, retract). Idempotent. The caller resets
        ``req.computed_len`` (nothing of the request stays in the pool but cached KV)."""
        mem = self._held.pop(req.rid, None)
        if mem is None:
            return
        if mem.alloc_len > req.computed_len:  # uncomputed slots of a batch in flight
            self.pool.free(self.req_table.read(mem.row, req.computed_len, mem.alloc_len).clone())
        if cache and not self.tree.disabled and req.computed_len > mem.prefix_len:
            self._insert_computed(req, mem)
        else:
            self.pool.free(self.req_table.read(mem.row, mem.prefix_len, req.computed_len).clone())
        self.tree.dec_lock_ref(mem.node)
        self.req_table.free_row(mem.row)

    def _insert_computed(self, req: "Req", mem: ReqMemory):
        """Insert fill_ids[:computed_len]; free our duplicates of what the tree already had.

        Private slots are never in the tree (``cache_unfinished`` moves ``prefix_len`` past what
        it inserts), so every slot of ours in [prefix_len, existing_len) is a duplicate."""
        ours = self.req_table.read(mem.row, 0, req.computed_len)
        result = self.tree.insert(req.key_ids[:req.computed_len], ours, req.namespace)
        if result.existing_len > mem.prefix_len:
            self.pool.free(ours[mem.prefix_len:result.existing_len].clone())
        return result.node

    # ------------------------------------------------------------------ tiers
    def prefetch(self, req: "Req") -> None:
        """Start reading from disk the pages that continue ``req``'s cached prefix (a waiting
        request; :meth:`ready` says when they are in the host tier)."""
        if self.tiers is None or self.tiers.disk is None:
            return
        key = req.key_ids[:self.max_prefix(req)]
        names = page_hashes(key, req.namespace, len(key) // PAGE_TOKENS)
        cached = self.tree.prefix_len(key, req.namespace)[0] // PAGE_TOKENS
        # finished read-aheads of requests that never asked (aborted while waiting) go
        self._prefetching = {r: f for r, f in self._prefetching.items() if not f.done()}
        future = self.tiers.prefetch(names[cached:])
        if future is not None:
            self._prefetching[req.rid] = future

    def ready(self, req: "Req") -> bool:
        """False while a read-ahead for ``req`` is still running."""
        future = self._prefetching.get(req.rid)
        if future is None:
            return True
        if not future.done():
            return False
        del self._prefetching[req.rid]
        return True

    def _spill(self, node: TreeNode) -> None:
        """Copy the full pages that hold tokens of ``node`` (a leaf being evicted) into the
        tiers, unless they are there already."""
        start_len = len(node.key)
        namespace, key, slots = self.tree.path(node)
        end = len(key)
        first, last = (end - start_len) // PAGE_TOKENS, end // PAGE_TOKENS
        if first >= last:
            return
        names = page_hashes(key, namespace, last)
        for k in range(first, last):
            if names[k] not in self.tiers:
                self.tiers.put(names[k], self._page(slots[k * PAGE_TOKENS:(k + 1) * PAGE_TOKENS]))

    def _page(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V of ``slots`` over all layers: [layers, 2, len(slots), kv_heads, head_dim]
        on the CPU."""
        idx = slots.to(self.pool.device)
        return torch.stack([torch.stack((k[idx], v[idx])) for k, v in
                            zip(self.pool.k_buffers, self.pool.v_buffers)]).cpu()

    def _load_back(self, key: list[int], namespace: Any, hit: MatchResult) -> MatchResult:
        """Extend ``hit`` with consecutive pages found in the host tier: copy them into
        freshly allocated slots, insert them into the tree, match again."""
        num_pages = len(key) // PAGE_TOKENS
        k0 = hit.length // PAGE_TOKENS
        if k0 >= num_pages:
            return hit
        names = page_hashes(key, namespace, num_pages)
        pages = []
        for name in names[k0:]:
            page = self.tiers.get_ready(name)
            if page is None:
                break
            pages.append(page)
        if not pages:
            return hit
        end = (k0 + len(pages)) * PAGE_TOKENS
        self.tree.inc_lock_ref(hit.node)  # eviction for room must not take the matched path
        try:
            slots = self.alloc(end - hit.length)
        finally:
            self.tree.dec_lock_ref(hit.node)
        if slots is None:
            return hit
        kv = torch.cat(pages, dim=2)[:, :, hit.length - k0 * PAGE_TOKENS:]
        idx = slots.to(self.pool.device)
        for layer, (k, v) in enumerate(zip(self.pool.k_buffers, self.pool.v_buffers)):
            k[idx] = kv[layer, 0].to(k.device, k.dtype)
            v[idx] = kv[layer, 1].to(v.device, v.dtype)
        result = self.tree.insert(key[:end], torch.cat((hit.slots, slots)), namespace)
        assert result.existing_len == hit.length, "the matched path changed during a load"
        self.stats.loaded_tokens += end - hit.length
        return self.tree.match_prefix(key, namespace)

    def persist(self) -> None:
        """Write every cached prefix's full pages to the disk tier and wait (shutdown)."""
        if self.tiers is None or self.tiers.disk is None:
            return
        for node in self.tree.nodes():
            self._spill(node)
        self.tiers.save_all()

    def flush(self) -> bool:
        """Drop the whole cache if no request holds memory; False (nothing done) otherwise."""
        if self._held:
            return False
        self.pool.free(self.tree.all_slots())
        self.tree.reset()
        return True

    # ------------------------------------------------------------------ checks
    def check_invariants(self, active: Iterable["Req"]) -> None:
        """AssertionError unless free + evictable + protected + private == capacity, every slot
        has one owner, the tree's size counters match its contents, and exactly the ``active``
        requests hold memory."""
        reqs = list(active)
        assert {r.rid for r in reqs} == set(self._held), "memory held by an inactive request"
        private = [self.req_table.read(m.row, m.prefix_len, m.alloc_len)
                   for m in self._held.values()]
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
            mem = self._held[r.rid]
            assert mem.prefix_len <= r.computed_len <= mem.alloc_len <= r.fill_len + len(r.draft), (
                f"{r.rid}: lengths {mem.prefix_len} / {r.computed_len} / {mem.alloc_len}")
            m = tree.prefix_len(r.key_ids[:mem.prefix_len], r.namespace)[0]
            assert m >= mem.prefix_len or tree.disabled, f"{r.rid}: locked prefix not in tree"
