"""The native CPU attention kernels and RoPE + K/V store (kernels/cpu) against the pure-torch
reference on random inputs (lengths, GQA ratios, windows, soft-capping, head dims, dtypes, slot-
and head-major pools), and their invariance: a token's attention is bitwise the same in a decode
step and in any extend, alone or in any batch, on any number of threads."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu as native
from kernels.reference import extend_attention

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"sgl_cpu kernels: {native.unavailable_reason()}")


@pytest.fixture(params=native.ATTENTION_KERNELS)
def attention_op(request):
    """Each native attention kernel this machine can run."""
    try:
        return native.attention_op(request.param)
    except RuntimeError as exc:
        pytest.skip(str(exc))


def _pool(capacity: int, hkv: int, d: int, dtype, rows: int = 4, max_len: int = 1500):
    torch.manual_seed(0)
    k = torch.randn(capacity, hkv, d).to(dtype)
    v = torch.randn(capacity, hkv, d).to(dtype)
    table = torch.stack([torch.randperm(capacity)[:max_len] for _ in range(rows)])
    return k, v, table


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 40),
                                      (5, 1, 8)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (300, 0.0), (0, 20.0)])
def test_attention_matches_the_reference(attention_op, dtype, kv_dtype, hq, hkv, d, window,
                                         softcap):
    """float32 activations over a bfloat16 pool (--kv-cache-dtype bfloat16) included: both
    sides read the same rounded K/V. The reference runs in float64: torch's own float32 pass
    with soft-capping was off by up to 8e-5 in some processes (1 run in ~15, 2026-11-30),
    where the kernels stay within 1e-6 of the float64 result."""
    k, v, table = _pool(4096, hkv, d, kv_dtype)
    rows, prefix, ext = [0, 2, 3], [0, 700, 1100], [37, 1, 300]
    q = torch.randn(sum(ext), hq, d).to(dtype)
    ref = extend_attention(q.double(), k.double(), v.double(), table, rows, prefix, ext,
                           d ** -0.5, window, softcap)
    out = attention_op(q, k, v, table, torch.tensor(rows), torch.tensor(prefix),
                       torch.tensor(ext), d ** -0.5, window, softcap)
    # the bf16 dot-product kernel rounds the probabilities to bf16 for P.V (a few 1e-3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and (out.double() - ref).abs().max() < tol


def _zeros_kv(capacity: int, hkv: int, d: int, dtype, head_major: bool) -> torch.Tensor:
    """A zeroed [capacity, hkv, d] K/V buffer, slot-major or (as the CPU pool) a view of
    head-major storage."""
    if head_major:
        return torch.zeros(hkv, capacity, d, dtype=dtype).permute(1, 0, 2)
    return torch.zeros(capacity, hkv, d, dtype=dtype)


def _as_head_major(buf: torch.Tensor) -> torch.Tensor:
    """``buf``'s values in head-major storage, seen as the same [C, H, D]."""
    return buf.permute(1, 0, 2).contiguous().permute(1, 0, 2)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 40)])
def test_attention_reads_a_head_major_pool_as_a_slot_major_one(attention_op, dtype, kv_dtype,
                                                               hq, hkv, d):
    """The CPU pool is a view of head-major storage (kv_pool.py): the kernels take the slot
    and head strides from the buffers, so the same K/V give the same bits either way, in
    decode rows and extend rows alike; K and V laid out differently are an error."""
    k, v, table = _pool(4096, hkv, d, kv_dtype)
    rows, prefix, ext = [0, 2, 3], [0, 700, 1100], [37, 1, 300]
    q = torch.randn(sum(ext), hq, d).to(dtype)
    rest = (table, torch.tensor(rows), torch.tensor(prefix), torch.tensor(ext), d ** -0.5, 0,
            0.0)
    want = attention_op(q, k, v, *rest)
    assert torch.equal(attention_op(q, _as_head_major(k), _as_head_major(v), *rest), want)
    with pytest.raises(RuntimeError, match="same strides"):
        attention_op(q, k, _as_head_major(v), *rest)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("head_major", [False, True])
def test_rope_store_rotates_like_the_reference_and_rounds_kv_to_the_pool(dtype, kv_dtype,
                                                                        head_major):
    """q and k rotated in place as HF's apply_rope; k, v stored at their slots, rounded to a
    narrower pool exactly as Tensor.to rounds them (what the reference backend stores), into
    a slot-major buffer or a head-major view alike."""
    from kernels.reference import apply_rope

    torch.manual_seed(0)
    t, hq, hkv, d = 5, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    angles = torch.randn(t, d // 2)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    k_buf = _zeros_kv(16, hkv, d, kv_dtype, head_major)
    v_buf = _zeros_kv(16, hkv, d, kv_dtype, head_major)
    loc = torch.tensor([3, 9, 0, 15, 4])
    heads = qkv.view(t, hq + 2 * hkv, d)
    want_q = apply_rope(heads[:, :hq], cos, sin)
    want_k = apply_rope(heads[:, hq:hq + hkv], cos, sin)
    want_v = heads[:, hq + hkv:].clone()
    torch.ops.sgl_cpu.rope_store(qkv, cos, sin, hq, hkv, d, k_buf, v_buf, loc)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (heads[:, :hq].float() - want_q.float()).abs().max() < tol
    assert (k_buf[loc].float() - want_k.to(kv_dtype).float()).abs().max() < tol
    assert torch.equal(k_buf[loc], heads[:, hq:hq + hkv].to(kv_dtype))  # what was rotated
    assert torch.equal(v_buf[loc], want_v.to(kv_dtype))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[loc] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("d", [64, 40, 8])
@pytest.mark.parametrize("head_major", [False, True])
def test_the_avx512_rope_store_gives_torchs_bits(dtype, kv_dtype, d, head_major):
    """The 16-lane op rounds each product before the sum as HF's apply_rope in torch does:
    bitwise torch's q and k, and K/V in the pool as Tensor.to rounds them (head dims whose
    half is and is not a multiple of 16), in a slot-major buffer or a head-major view."""
    from kernels.reference import apply_rope

    if not native.available("avx512_vnni"):
        pytest.skip(native.unavailable_reason("avx512_vnni"))
    torch.manual_seed(1)
    t, hq, hkv = 7, 9, 3
    qkv = (torch.randn(t, (hq + 2 * hkv) * d) * 5).to(dtype)
    angles = torch.randn(t, d // 2) * 40
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    loc = torch.tensor([3, 9, 0, 15, 4, 11, 7])
    heads = qkv.view(t, hq + 2 * hkv, d)
    want_q = apply_rope(heads[:, :hq], cos, sin)
    want_k = apply_rope(heads[:, hq:hq + hkv], cos, sin)
    k_buf = _zeros_kv(16, hkv, d, kv_dtype, head_major)
    v_buf = _zeros_kv(16, hkv, d, kv_dtype, head_major)
    got = qkv.clone()
    torch.ops.sgl_cpu_vnni.rope_store(got, cos, sin, hq, hkv, d, k_buf, v_buf, loc)
    got_heads = got.view(t, hq + 2 * hkv, d)
    assert torch.equal(got_heads[:, :hq], want_q)
    assert torch.equal(got_heads[:, hq:hq + hkv], want_k)
    assert torch.equal(k_buf[loc], want_k.to(kv_dtype))
    assert torch.equal(v_buf[loc], heads[:, hq + hkv:].to(kv_dtype))
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.sgl_cpu_vnni.rope_store(qkv.clone(), cos, sin, hq, hkv, d, k_buf, v_buf,
                                          loc + 16)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, 0), (9, 3, 64, 300), (8, 2, 128, 0),
                                             (4, 4, 32, 0)])
def test_attention_of_a_token_is_the_same_in_decode_and_in_any_extend(attention_op, dtype,
                                                                      kv_dtype, hq, hkv, d,
                                                                      window):
    """Bitwise: token p of a sequence computed in a long extend, in a short extend over the
    cached prefix, and as a decode step beside other sequences (with a bf16 pool, a decode reads
    K/V rows in place while an extend tile stages them as float32; the bf16 dot-product kernel
    runs a decode's units (a group of 1-4 heads) through softmax_step with each chunk's K and V
    blocks taken from the rows into registers, an extend tile's through softmax_step16 over
    blocks stored once a chunk; a pass with few items cuts tiles of 32 tokens, a bigger one of
    64: the same bits either way). Head dims with one and with several 16-pair blocks a row, a
    sliding window (chunks masked at its start)."""
    k, v, table = _pool(4096, hkv, d, kv_dtype)
    q = torch.randn(1200, hq, d).to(dtype)
    scale = 0.125

    def run(rows, prefix, ext, qs):
        return attention_op(qs.contiguous(), k, v, table, torch.tensor(rows),
                            torch.tensor(prefix), torch.tensor(ext), scale, window, 0.0)

    whole = run([1], [0], [1200], q)
    chunk = run([1], [1000], [200], q[1000:])
    decode = run([0, 1, 2], [50, 1199, 900], [1, 1, 1], torch.stack([q[0], q[1199], q[5]]))
    short = run([1], [1150], [50], q[1150:])  # 3 items: 32-token tiles
    assert torch.equal(whole[1000:], chunk)
    assert torch.equal(whole[1150:], short)
    assert torch.equal(whole[1199], decode[1])
    # a tile's neighbours: the same tokens in tiles cut elsewhere, beside another sequence
    mixed = run([2, 1], [0, 990], [37, 210], torch.cat([q[:37], q[990:]]))
    assert torch.equal(whole[990:], mixed[37:])


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])
def test_attention_gives_the_same_bits_on_any_number_of_threads(attention_op, dtype, kv_dtype):
    """Work items go to threads by estimated cost, then to whichever thread is free (a verify
    pass's 8 rows beside 3 decode rows is uneven enough for threads to take each other's
    items): the bits never depend on which thread or how many computed them."""
    k, v, table = _pool(4096, 3, 64, kv_dtype)
    rows, prefix, ext = [0, 1, 2, 3], [600, 650, 1100, 700], [1, 1, 1, 8]
    q = torch.randn(sum(ext), 9, 64).to(dtype)
    args = (k, v, table, torch.tensor(rows), torch.tensor(prefix), torch.tensor(ext), 0.125, 0,
            0.0)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs += [attention_op(q, *args) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
