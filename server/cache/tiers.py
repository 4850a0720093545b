"""KV tiers under the radix tree: a bounded host-memory tier and a disk tier that survives a
restart (HiCache-style; the anchors are SGLang's HiCache host/storage tiers and LMCache's
chunk store).

The unit is a *page*: the K/V of ``PAGE_TOKENS`` consecutive tokens at a page-aligned position,
over all layers, as one tensor [layers, 2, PAGE_TOKENS, kv_heads, head_dim] on the CPU. A page
is named by a chained SHA-256 (:func:`page_hashes`): the hash of page k covers the namespace and
every token of pages 0..k, so equal names mean equal prefixes (and equal KV).

* :class:`HostTier`: an LRU map name -> page, bounded in bytes; pages it drops go to the disk
  tier when there is one.
* :class:`DiskTier`: one file per page under ``DIR/<fingerprint>/`` (the fingerprint names the
  model, dtype, quantization and KV layout: a cache written by another model or format sits in
  another directory and is never read). A file is a magic line, a JSON header (fingerprint,
  shape, dtype, and an HMAC-SHA256 of the page's name, header fields and payload) and the
  payload; it is written to a temporary name and renamed, so ``kill -9`` during a write leaves
  at most a ``.tmp`` file, removed at the next start. The MAC key is ``DIR/.key`` (32 random
  bytes, created 0600 on first use): a page that anyone without the key wrote or renamed fails
  its check, where a plain checksum let a forged page with a recomputed SHA-256 load and change
  outputs. Only regular files of exactly a page's size are read (opened without following links
  or blocking: a named pipe in place of a page hung every request that needed it). A file that
  fails its checks (truncated, corrupted, forged, another fingerprint) is deleted and counted,
  never loaded. Writes run on a writer thread; the directory is bounded in bytes (oldest first
  out).

:class:`server.cache.manager.CacheManager` spills evicted radix-tree leaves into the tiers and
loads pages back at admission.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import secrets
import stat
import threading
from collections import OrderedDict
from typing import Hashable, Sequence

import torch

from server.config import ConfigError

log = logging.getLogger("server.cache")

PAGE_TOKENS = 64
_MAGIC = b"SGLKV2\n"
KEY_FILE = ".key"
_MAX_HEADER_BYTES = 4096
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def cache_key(root: str) -> bytes:
    """The 32-byte MAC key of the cache directory ``root``: read from ``root/.key``, or
    created there (mode 0600, atomically) on first use. Raises ConfigError when the file is
    not a regular 32-byte file owned by this user and private to it."""
    path = os.path.join(root, KEY_FILE)
    if not os.path.lexists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(tmp, path)  # fails if another process created the key meanwhile
        except FileExistsError:
            pass
        finally:
            os.remove(tmp)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise ConfigError(f"cache dir key {path}: {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 \
                or st.st_size != 32:
            raise ConfigError(f"cache dir key {path} must be a 32-byte regular file owned by "
                              "this user with mode 0600; remove it to start a new cache")
        return f.read(32)


def kv_fingerprint(loaded, model_config, page_shape: Sequence[int]) -> str:
    """16 hex digits naming what a page's bytes depend on: the model file (its name, size and
    config), the compute dtype, the quantization and the page layout."""
    path = loaded.path
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path)
        if f.endswith((".json", ".safetensors", ".gguf")))
    ident = [(os.path.basename(f), os.path.getsize(f)) for f in files]
    config = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if config and os.path.isfile(config):
        with open(config, "rb") as f:
            ident.append(("config", hashlib.sha256(f.read()).hexdigest()))
    text = json.dumps([loaded.name, ident, model_config.dtype, model_config.quantization,
                       list(page_shape), PAGE_TOKENS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def page_hashes(key: Sequence[int], namespace: Hashable, num_pages: int) -> list[str]:
    """Names of the first ``num_pages`` full pages of ``key`` (hex SHA-256, chained)."""
    h = hashlib.sha256(repr(namespace).encode())
    out = []
    for k in range(num_pages):
        chunk = key[k * PAGE_TOKENS:(k + 1) * PAGE_TOKENS]
        h.update(b"|" + ",".join(map(str, chunk)).encode())
        out.append(h.copy().hexdigest())
    return out


class DiskTier:
    """Args: root: the cache directory; fingerprint: names the model and KV format (a
    subdirectory); max_bytes: size bound of this model's pages; shape, dtype: of every page.
    """

    def __init__(self, root: str, fingerprint: str, max_bytes: int, shape: tuple[int, ...],
                 dtype: torch.dtype):
        self.dir = os.path.join(root, fingerprint)
        self.fingerprint, self.max_bytes = fingerprint, max_bytes
        self.shape, self.dtype = tuple(shape), dtype
        self.rejected = 0  # files that failed their checks (deleted)
        os.makedirs(self.dir, exist_ok=True)
        self._key = cache_key(root)
        self._payload_bytes = torch.Size(shape).numel() * dtype.itemsize
        others = [d for d in os.listdir(root) if d != fingerprint
                  and os.path.isdir(os.path.join(root, d))]
        if others:
            log.warning("cache dir %s: ignoring %d cache(s) written by another model or format",
                        root, len(others))
        self._sizes: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first
        entries = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.endswith(".tmp"):  # a write that never finished (kill -9)
                os.remove(path)
            elif name.endswith(".kv"):
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):  # a link, pipe or device is never opened
                    log.warning("cache dir: ignoring %s (not a regular file)", path)
                    continue
                entries.append((st.st_mtime, name[:-3], st.st_size))
        for _, name, size in sorted(entries):
            self._sizes[name] = size
        self.bytes = sum(self._sizes.values())
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="kv-disk-writer")
        self._writer.start()

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, name: str, page: torch.Tensor) -> None:
        """Queue ``page`` for writing (the caller's tensor must not change afterwards)."""
        if name not in self:
            self._queue.put((name, page))

    def get(self, name: str) -> torch.Tensor | None:
        """The page, or None if absent or its file fails the checks (then it is deleted)."""
        if name not in self:
            return None
        path = os.path.join(self.dir, name + ".kv")
        try:
            fd = os.open(path, _OPEN_FLAGS)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                limit = len(_MAGIC) + _MAX_HEADER_BYTES + self._payload_bytes
                if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                    raise ValueError("not a regular file of a page's size")
                blob = f.read(limit + 1)
            if not blob.startswith(_MAGIC):
                raise ValueError("bad magic")
            end = blob.index(b"\n", len(_MAGIC))
            header = json.loads(blob[len(_MAGIC):end])
            payload = blob[end + 1:]
            if (not isinstance(header, dict) or header.get("fingerprint") != self.fingerprint
                    or tuple(header.get("shape", ())) != self.shape
                    or header.get("dtype") != str(self.dtype)
                    or len(payload) != self._payload_bytes
                    or not hmac.compare_digest(self._mac(name, payload),
                                               str(header.get("mac", "")))):
                raise ValueError("header or MAC mismatch")
            page = torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.shape)
        except (OSError, ValueError, RuntimeError) as exc:
            self._reject(name, path, exc)
            return None
        with self._lock:
            if name in self._sizes:
                self._sizes.move_to_end(name)
        return page

    def _mac(self, name: str, payload: bytes) -> str:
        """HMAC-SHA256 (hex) over the page's name, format fields and payload."""
        mac = hmac.new(self._key, json.dumps([name, self.fingerprint, list(self.shape),
                                              str(self.dtype)]).encode(), hashlib.sha256)
        mac.update(payload)
        return mac.hexdigest()

    def flush(self) -> None:
        """Block until every queued page is on disk."""
        self._queue.join()

    def _reject(self, name: str, path: str, exc: Exception) -> None:
        self.rejected += 1
        log.warning("cache dir: dropping %s (%s)", path, exc)
        with self._lock:
            self.bytes -= self._sizes.pop(name, 0)
        try:
            os.remove(path)
        except OSError:
            pass

    def _write_loop(self) -> None:
        while True:
            name, page = self._queue.get()
            try:
                self._write(name, page)
            except OSError as exc:  # a full disk or a removed directory: the cache only
                log.warning("cache dir: could not write a page: %s", exc)
            finally:
                self._queue.task_done()

    def _write(self, name: str, page: torch.Tensor) -> None:
        if name in self:
            return
        payload = page.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({"fingerprint": self.fingerprint, "shape": list(self.shape),
                             "dtype": str(self.dtype),
                             "mac": self._mac(name, payload)}).encode()
        path = os.path.join(self.dir, name + ".kv")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_MAGIC + header + b"\n" + payload)
        os.replace(tmp, path)
        size = len(_MAGIC) + len(header) + 1 + len(payload)
        with self._lock:
            self._sizes[name] = size
            self.bytes += size
            while self.bytes > self.max_bytes and len(self._sizes) > 1:
                old, old_size = self._sizes.popitem(last=False)
                self.bytes -= old_size
                try:
                    os.remove(os.path.join(self.dir, old + ".kv"))
                except OSError:
                    pass


class HostTier:
    """An LRU map page name -> page tensor, bounded by ``max_bytes``; pages it drops go to
    ``spill`` (a DiskTier) when given."""

    def __init__(self, max_bytes: int, spill: DiskTier | None = None):
        self.max_bytes, self.spill = max_bytes, spill
        self.bytes = 0
        self._pages: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, name: str, page: torch.Tensor) -> None:
        """Keep ``page`` ([layers, 2, PAGE_TOKENS, kv_heads, head_dim]) as most recent; pages
        over the byte bound go to ``spill`` oldest first (or are dropped without one)."""
        size = page.numel() * page.element_size()
        if size > self.max_bytes:
            if self.spill is not None:
                self.spill.put(name, page)
            return
        with self._lock:
            if name in self._pages:
                self._pages.move_to_end(name)
                return
            self._pages[name] = page
            self.bytes += size
            dropped = []
            while self.bytes > self.max_bytes:
                old, old_page = self._pages.popitem(last=False)
                self.bytes -= old_page.numel() * old_page.element_size()
                dropped.append((old, old_page))
        if self.spill is not None:
            for old, old_page in dropped:
                self.spill.put(old, old_page)

    def get(self, name: str) -> torch.Tensor | None:
        """The page (now most recent), or None."""
        with self._lock:
            page = self._pages.get(name)
            if page is not None:
                self._pages.move_to_end(name)
            return page


class KVTiers:
    """The tiers a CacheManager uses: ``host`` (always: it also stages pages read from disk)
    and ``disk`` (may be None). Pages move host -> disk when the host tier drops them; disk
    pages a request will need are read ahead into the host tier (:meth:`prefetch`, on a
    reader thread), so admission never waits for the disk.

    Counter: ``saved`` pages (put into a tier on eviction or persist); tokens loaded back are
    the cache manager's ``stats.loaded_tokens``.
    """

    def __init__(self, host: HostTier, disk: DiskTier | None = None):
        self.host, self.disk = host, disk
        host.spill = disk
        self.saved = 0
        self._reader = None
        if disk is not None:
            from concurrent.futures import ThreadPoolExecutor

            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader")

    def __contains__(self, name: str) -> bool:
        return name in self.host or (self.disk is not None and name in self.disk)

    def put(self, name: str, page: torch.Tensor) -> None:
        """Keep page ``name`` (a [PAGE_TOKENS, ...] K/V copy) in the host tier, which spills
        to disk when full; a page already held is not stored twice."""
        if name not in self:
            self.saved += 1
            self.host.put(name, page)

    def get_ready(self, name: str) -> torch.Tensor | None:
        """A page available without disk I/O (the host tier), else None."""
        return self.host.get(name)

    def prefetch(self, names: Sequence[str]):
        """Read the leading run of ``names`` that is on disk but not in the host tier, on the
        reader thread; returns a future (None when nothing needs reading)."""
        if self._reader is None:
            return None
        todo = []
        for name in names:
            if name in self.host:
                continue
            if name not in self.disk:
                break
            todo.append(name)
        return self._reader.submit(self._read, todo) if todo else None

    def _read(self, names: list[str]) -> None:
        for name in names:
            page = self.disk.get(name)
            if page is None:
                return
            self.host.put(name, page)

    def flush(self) -> None:
        """Block until pages queued for the disk tier are written."""
        if self.disk is not None:
            self.disk.flush()

    def save_all(self) -> None:
        """Write every host page to the disk tier and wait (shutdown)."""
        if self.disk is None:
            return
        with self.host._lock:
            pages = list(self.host._pages.items())
        for name, page in pages:
            self.disk.put(name, page)
        self.disk.flush()


def build_tiers(loaded, cc, mc, pool, tensor_parallel: bool) -> KVTiers | None:
    """The host and disk tiers a :class:`server.config.CacheConfig` ``cc`` asks for over
    ``pool`` (a :class:`server.cache.kv_pool.TokenKVPool`) of the model ``loaded`` with
    :class:`server.config.ModelConfig` ``mc``; None for none. Raises ConfigError for tiers
    with tensor parallelism (each rank holds its own heads' KV: pages would be partial)."""
    host_bytes = cc.host_tier_bytes(mc.device.startswith("cuda"))
    if cc.disable_radix_cache or (host_bytes == 0 and cc.cache_dir is None):
        return None
    if tensor_parallel:
        if cc.hicache_size or cc.cache_dir:
            raise ConfigError("--hicache-size and --cache-dir are not supported with tensor "
                              "parallelism")
        return None
    shape = (len(pool.k_buffers), 2, PAGE_TOKENS, *pool.k_buffers[0].shape[1:])
    disk = None
    if cc.cache_dir is not None:
        disk = DiskTier(cc.cache_dir, kv_fingerprint(loaded, mc, shape),
                        int(cc.cache_dir_size * 2 ** 30), shape, pool.k_buffers[0].dtype)
    # with only a disk tier, a small host tier stages the pages read ahead from disk
    return KVTiers(HostTier(host_bytes or 256 << 20), disk)
