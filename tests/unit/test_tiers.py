"""KV tiers under the radix tree: disk pages (checks, atomic writes, kill -9), and a
differential fuzz of the cache manager with host and disk tiers (evict to host, host to disk,
load back, with locks) against a deterministic KV function."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.manager import CacheManager
from server.cache.radix_tree import RadixCache
from server.cache.req_table import ReqToTokenTable
from server.cache.tiers import PAGE_TOKENS, DiskTier, HostTier, KVTiers, page_hashes
from server.config import ConfigError
from server.model.sampling import SamplingParams
from server.scheduler.request import Req

SHAPE = (2, 2, PAGE_TOKENS, 1, 2)  # layers, K/V, tokens, kv heads, head dim


def page(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def test_disk_pages_round_trip_and_bad_files_are_dropped(tmp_path):
    disk = DiskTier(str(tmp_path), "fp1", 1 << 30, SHAPE, torch.float32)
    for i in range(4):
        disk.put(f"p{i}", page(i))
    disk.flush()
    assert torch.equal(disk.get("p0"), page(0))
    path = os.path.join(disk.dir, "p1.kv")
    blob = bytearray(open(path, "rb").read())
    blob[-5] ^= 0xFF  # a flipped payload byte
    open(path, "wb").write(bytes(blob))
    open(os.path.join(disk.dir, "p2.kv"), "wb").write(bytes(blob[:100]))  # truncated
    again = DiskTier(str(tmp_path), "fp1", 1 << 30, SHAPE, torch.float32)
    assert again.get("p1") is None and again.get("p2") is None
    assert again.rejected == 2 and not os.path.exists(path)
    assert torch.equal(again.get("p3"), page(3))
    # another model's cache is a sibling directory, never read
    other = DiskTier(str(tmp_path), "fp2", 1 << 30, SHAPE, torch.float32)
    assert len(other) == 0 and other.get("p0") is None


def test_disk_pages_are_authenticated_per_cache_dir(tmp_path):
    """A page written with another key (a forger who can recompute any checksum but cannot
    read the 0600 key) or moved to another page's name is dropped, never loaded."""
    disk = DiskTier(str(tmp_path / "a"), "fp", 1 << 30, SHAPE, torch.float32)
    key_path = tmp_path / "a" / ".key"
    assert oct(key_path.stat().st_mode & 0o777) == "0o600" and len(key_path.read_bytes()) == 32
    forger = DiskTier(str(tmp_path / "b"), "fp", 1 << 30, SHAPE, torch.float32)
    for d in (disk, forger):
        d.put("p0", page(0))
        d.put("p1", page(1))
        d.flush()
    forged = torch.full(SHAPE, 7.0)
    forger._write("p9", forged)  # a well-formed page under the forger's key ...
    os.replace(os.path.join(forger.dir, "p9.kv"), os.path.join(disk.dir, "p0.kv"))
    # ... and one of our own pages renamed to another prefix's name
    os.replace(os.path.join(disk.dir, "p1.kv"), os.path.join(disk.dir, "p2.kv"))
    again = DiskTier(str(tmp_path / "a"), "fp", 1 << 30, SHAPE, torch.float32)
    assert again.get("p0") is None and again.get("p2") is None and again.rejected == 2
    # a fresh start keeps the key: its own pages still load
    again.put("p3", page(3))
    again.flush()
    assert torch.equal(DiskTier(str(tmp_path / "a"), "fp", 1 << 30, SHAPE,
                                torch.float32).get("p3"), page(3))


def test_disk_tier_refuses_special_and_oversized_files(tmp_path):
    """A named pipe or a symlink where a page should be is never opened (a pipe blocked every
    request that needed the page, and shutdown); an oversized file is not read whole."""
    disk = DiskTier(str(tmp_path), "fp", 1 << 30, SHAPE, torch.float32)
    for i in range(3):
        disk.put(f"p{i}", page(i))
    disk.flush()
    fifo = os.path.join(disk.dir, "p0.kv")
    os.remove(fifo)
    os.mkfifo(fifo)
    big = os.path.join(disk.dir, "p1.kv")
    with open(big, "ab") as f:
        f.write(b"\0" * (1 << 20))
    start = time.monotonic()
    assert disk.get("p0") is None and disk.get("p1") is None
    assert time.monotonic() - start < 5 and disk.rejected == 2
    os.symlink("/dev/zero", os.path.join(disk.dir, "p5.kv"))
    os.mkfifo(os.path.join(disk.dir, "p6.kv"))
    again = DiskTier(str(tmp_path), "fp", 1 << 30, SHAPE, torch.float32)
    assert "p5" not in again and "p6" not in again and torch.equal(again.get("p2"), page(2))


def test_a_key_file_others_can_read_is_refused(tmp_path):
    DiskTier(str(tmp_path), "fp", 1 << 30, SHAPE, torch.float32)
    os.chmod(tmp_path / ".key", 0o644)
    with pytest.raises(ConfigError, match="mode 0600"):
        DiskTier(str(tmp_path), "fp", 1 << 30, SHAPE, torch.float32)


def test_disk_tier_is_bounded_oldest_first(tmp_path):
    size = page(0).numel() * 4
    disk = DiskTier(str(tmp_path), "fp", 3 * size + 3 * 400, SHAPE, torch.float32)
    for i in range(6):
        disk.put(f"p{i}", page(i))
        disk.flush()
    assert len(disk) == 3 and "p5" in disk and "p0" not in disk
    assert disk.bytes <= disk.max_bytes


def test_kill_9_during_writes_leaves_a_readable_directory(tmp_path):
    """A writer killed mid-write: the next start removes the partial file and reads every
    page that is there (or drops it), without an exception."""
    script = textwrap.dedent(f"""
        import torch, sys
        sys.path.insert(0, {os.getcwd()!r})
        from server.cache.tiers import DiskTier
        d = DiskTier({str(tmp_path)!r}, "fp", 1 << 34, {SHAPE!r}, torch.float32)
        i = 0
        while True:
            d.put(f"p{{i}}", torch.full({SHAPE!r}, float(i)))
            i += 1
            if i % 50 == 0:
                d.flush()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    time.sleep(3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    disk = DiskTier(str(tmp_path), "fp", 1 << 34, SHAPE, torch.float32)
    assert len(disk) > 0
    assert not [f for f in os.listdir(disk.dir) if f.endswith(".tmp")]
    for name in list(disk._sizes):
        got = disk.get(name)
        assert got is None or torch.equal(got, torch.full(SHAPE, float(name[1:])))


def expected_kv(key: list[int]) -> torch.Tensor:
    """A deterministic 'KV' per position that depends on the whole prefix: [len] float."""
    out, v = [], 0
    for t in key:
        v = (v * 31 + t) % 997
        out.append(float(v))
    return torch.tensor(out)


@pytest.mark.parametrize("with_disk", [False, True])
def test_fuzz_cache_with_tiers_against_deterministic_kv(tmp_path, with_disk):
    """>= 10,000 random operations: requests over shared prefixes are admitted (their cached
    prefix, loaded back from a tier or not, must hold exactly the KV their tokens produce),
    'computed', cached and released, some held across operations (locks), under a pool and a
    host tier small enough to evict constantly."""
    rng = random.Random(7 if with_disk else 3)
    pool = TokenKVPool(400, num_layers=2, num_kv_heads=1, head_dim=2)
    disk = DiskTier(str(tmp_path), "fp", 1 << 30, (2, 2, PAGE_TOKENS, 1, 2), torch.float32) \
        if with_disk else None
    tiers = KVTiers(HostTier(6 * 2 * 2 * PAGE_TOKENS * 2 * 4), disk)  # 6 pages
    cache = CacheManager(pool, ReqToTokenTable(8, 512), RadixCache(), tiers)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(60, 200))] for _ in range(6)]
    held: list[Req] = []
    ops = 0
    n = 0
    while ops < 10_000:
        op = rng.random()
        if op < 0.6 or not held:
            if len(held) >= 6:
                continue
            stem = rng.choice(stems)
            key = stem[:rng.randrange(1, len(stem) + 1)] + [rng.randrange(1, 50)
                                                            for _ in range(rng.randrange(0, 40))]
            n += 1
            req = Req(rid=f"r{n}", input_ids=key, params=SamplingParams(max_new_tokens=1),
                      namespace=rng.choice([None, "salt"]))
            if with_disk:
                cache.prefetch(req)
                while not cache.ready(req):
                    time.sleep(0.001)
            hit = req.computed_len = cache.admit(req).cached_len
            row = cache.row(req.rid)
            want = expected_kv(key)
            slots = cache.req_table.read(row, 0, hit)
            for layer in range(2):
                got = pool.k_buffers[layer][slots, 0, 0]
                assert torch.equal(got, want[:hit] + layer), (ops, hit)
            need = len(key) - hit
            new = cache.alloc(need)
            if new is None:
                cache.release(req, cache=False)
                ops += 1
                continue
            cache.extend_row(req, new)
            for layer in range(2):  # "compute" the KV of the new positions
                pool.k_buffers[layer][new] = (want[hit:] + layer)[:, None, None].expand(-1, 1, 2)
                pool.v_buffers[layer][new] = (-want[hit:] - layer)[:, None, None].expand(-1, 1, 2)
            req.computed_len = len(key)
            held.append(req)
        elif op < 0.9:
            req = held.pop(rng.randrange(len(held)))
            cache.release(req, cache=rng.random() < 0.9)
            req.computed_len = 0
        else:
            freed = cache.tree.evict(rng.randrange(1, 200))
            cache.pool.free(freed)
        ops += 1
        if ops % 500 == 0:
            cache.check_invariants(held)
    for req in held:
        cache.release(req)
    cache.check_invariants([])
    assert cache.stats.loaded_tokens > 0 and tiers.saved > 0
    if with_disk:
        tiers.flush()
        assert len(disk) > 0


def test_page_names_chain_over_the_whole_prefix():
    a = page_hashes(list(range(3 * PAGE_TOKENS)), None, 3)
    b = page_hashes([9] + list(range(1, 3 * PAGE_TOKENS)), None, 3)
    c = page_hashes(list(range(3 * PAGE_TOKENS)), "salt", 3)
    assert len(set(a)) == 3 and not set(a) & set(b) and not set(a) & set(c)
    assert page_hashes(list(range(2 * PAGE_TOKENS)), None, 2) == a[:2]
