"""TokenKVPool and ReqToTokenTable: exact slots, errors, shapes."""

import sys

import pytest
import torch

from server.cache.kv_pool import OutOfSlotsError, TokenKVPool
from server.cache.req_table import NoFreeRowError, ReqToTokenTable


def test_alloc_free_exact_slots_and_slot0_reserved():
    pool = TokenKVPool(8)
    a = pool.alloc(3)
    assert a.tolist() == [1, 2, 3] and pool.num_free == 5
    b = pool.alloc(5)
    assert b.tolist() == [4, 5, 6, 7, 8] and pool.num_free == 0
    with pytest.raises(OutOfSlotsError):
        pool.alloc(1)
    pool.free(a[1:])
    assert pool.num_free == 2 and pool.alloc(2).tolist() == [2, 3]


def test_freed_slots_are_reused_first():
    """Last in, first out: a pass that frees slots and allocates again (a rejected draft) keeps
    writing the same slots, so the resident pages of a lazily paged pool stay those of the
    tokens held at once (first in, first out walked the whole pool: RSS grew ~260 MB per
    forced-string request)."""
    pool = TokenKVPool(100)
    held = pool.alloc(10)
    touched = set(held.tolist())
    for _ in range(50):  # verify a 33-token draft, keep one token, free the rest
        draft = pool.alloc(33)
        touched |= set(draft.tolist())
        pool.free(draft[1:])
    assert len(touched) == 10 + 33 + 49  # held, the first draft, one new slot per later step
    assert pool.num_free == 100 - 10 - 50


def test_failed_alloc_takes_nothing():
    pool = TokenKVPool(4)
    with pytest.raises(OutOfSlotsError):
        pool.alloc(5)
    assert pool.num_free == 4 and pool.alloc(0).numel() == 0


def test_buffers_shape_and_bytes():
    pool = TokenKVPool(10, num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
    assert pool.k_buffers[0].shape == (11, 2, 4) and len(pool.v_buffers) == 3
    assert pool.bytes_per_token() == 2 * 3 * 2 * 4 * 2


def _resident_share(t: torch.Tensor) -> float:
    """Share of ``t``'s whole pages that are resident (Linux mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    pages = (t.data_ptr() + t.numel() * t.element_size() - start) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * page, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(sys.platform != "linux", reason="mincore: Linux only")
def test_cpu_buffers_are_resident_from_the_start():
    """Every page of a CPU pool is written when it is made (a prefill into never-written slots
    ran 5-15% slower: kv_pool's docstring), and reads as zeros."""
    pool = TokenKVPool(20000, num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    for buf in (*pool.k_buffers, *pool.v_buffers):  # 10 MB each: fresh pages from the OS
        assert _resident_share(buf) == 1.0
        assert not buf.any()


def test_req_table_rows():
    t = ReqToTokenTable(2, 16)
    r0, r1 = t.alloc_row(), t.alloc_row()
    assert {r0, r1} == {0, 1}
    with pytest.raises(NoFreeRowError):
        t.alloc_row()
    t.write(r1, 3, torch.tensor([7, 8]))
    assert t.read(r1, 3, 5).tolist() == [7, 8]
    t.free_row(r0)
    assert t.alloc_row() == r0


def test_request_table_writes_one_slot_per_row_in_one_call():
    """A decode step's table write: row i, column cols[i] = slots[i]; reads come from the host
    copy (the same tensor on CPU)."""
    from server.cache.req_table import ReqToTokenTable

    t = ReqToTokenTable(4, 8)
    t.write(1, 0, torch.tensor([5, 6, 7]))
    t.write_one_each([1, 3], [3, 0], torch.tensor([9, 11]))
    assert t.read(1, 0, 4).tolist() == [5, 6, 7, 9] and t.read(3, 0, 1).tolist() == [11]
    assert t.host is t.table


def test_cpu_buffers_are_head_major_views_zeroed_at_start():
    """Each layer's K/V is [capacity + 1, heads, head_dim] to every user, stored head-major on
    a CPU (a head's rows for consecutive slots are contiguous: what a decode work item reads),
    with every element written at start-up; indexing by slot reads and writes as usual."""
    pool = TokenKVPool(10, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.bfloat16)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        assert buf.shape == (11, 3, 4) and buf.dtype == torch.bfloat16
        assert buf.stride() == (4, 11 * 4, 1)
        assert not buf.any()
    rows = torch.randn(2, 3, 4).bfloat16()
    pool.k_buffers[1][torch.tensor([7, 2])] = rows
    assert torch.equal(pool.k_buffers[1][7], rows[0]) and torch.equal(pool.k_buffers[1][2], rows[1])
    assert torch.equal(pool.k_buffers[1].permute(1, 0, 2).contiguous()[:, 7], rows[0])
    assert pool.bytes_per_token() == 2 * 2 * 3 * 4 * 2
