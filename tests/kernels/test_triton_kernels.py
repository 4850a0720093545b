"""Triton kernels against kernels/reference.py on random inputs: many length mixes (length 1,
empty and long prefixes, prefixes shared by several sequences), GQA and MHA, fp32/fp16/bf16.
On CPU they run under TRITON_INTERPRET=1 (tests/kernels/conftest.py)."""

import random

import pytest
import torch

pytest.importorskip("triton")

from kernels import reference  # noqa: E402
from kernels.base import AttentionInputs  # noqa: E402
from kernels.reference import ReferenceAttention  # noqa: E402
from kernels.triton import TritonAttention, fused  # noqa: E402
from kernels.triton.attention import decode_attention, extend_attention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Triton's interpreter (no GPU) emulates each dtype with the same numpy code: float16 adds
# nothing there that float32 and bfloat16 do not cover, so it runs on a GPU only.
DTYPES = [torch.float32, pytest.param(torch.float16, marks=pytest.mark.gpu), torch.bfloat16]


def pool(capacity, hkv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(capacity, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(capacity, hkv, d, generator=g).to(dtype).to(device)
    return k, v


def slot_rows(prefix_lens, extend_lens, share, capacity, device, seed=0):
    """req_to_token [B + 2, max_len]: distinct random slots per sequence (slot 0 never used),
    except that with ``share`` every sequence starts with the first sequence's prefix slots
    (as radix-cache hits do). Rows are taken in reverse order to test the row indirection."""
    rng = random.Random(seed)
    b = len(prefix_lens)
    total = [p + e for p, e in zip(prefix_lens, extend_lens)]
    free = list(range(1, capacity))
    rng.shuffle(free)
    table = torch.zeros(b + 2, max(total) + 3, dtype=torch.int64)
    rows = list(range(b + 1, 1, -1))
    shared = [free.pop() for _ in range(max(prefix_lens))]
    for i, (row, p, n) in enumerate(zip(rows, prefix_lens, extend_lens)):
        head = shared[:p] if share else [free.pop() for _ in range(p)]
        table[row, :p + n] = torch.tensor(head + [free.pop() for _ in range(n)], dtype=torch.int64)
        table[row, p + n:] = rng.randrange(1, capacity)  # stale entries past the length
    return table.to(device), rows


LENGTH_MIXES = [
    ([0], [1]),                      # a single token, nothing cached
    ([0, 0, 0], [1, 7, 40]),         # plain prefill, lengths 1..40
    ([5, 33, 0, 64], [1, 3, 17, 2]),  # cached prefixes of several lengths
    ([70, 70, 70], [4, 1, 35]),      # one prefix shared by three sequences
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("mix", range(len(LENGTH_MIXES)))
def test_extend_attention_matches_reference(device, dtype, heads, mix):
    prefix_lens, extend_lens = LENGTH_MIXES[mix]
    hq, hkv = heads
    d, capacity = 32, 512
    share = len(set(prefix_lens)) == 1 and prefix_lens[0] > 0
    k, v = pool(capacity, hkv, d, dtype, device, seed=mix)
    table, rows = slot_rows(prefix_lens, extend_lens, share, capacity, device, seed=mix)
    q = torch.randn(sum(extend_lens), hq, d, generator=torch.Generator().manual_seed(mix)).to(
        dtype).to(device)
    scale = d ** -0.5
    want = reference.extend_attention(q, k, v, table, rows, prefix_lens, extend_lens, scale)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(len(rows))], dtype=torch.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    got = extend_attention(q, k, v, table, i32(rows), i32(prefix_lens), i32(extend_lens),
                           starts.to(device), max(extend_lens), scale, block_m=16, block_n=16)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("lens", [[1], [1, 2, 17, 64, 65, 130], [40, 40, 40, 3]])
def test_decode_attention_matches_reference(device, dtype, heads, lens):
    hq, hkv = heads
    d, capacity = 32, 512
    share = len(set(lens)) < len(lens)
    prefix = [n - 1 for n in lens]
    k, v = pool(capacity, hkv, d, dtype, device, seed=len(lens))
    table, rows = slot_rows(prefix, [1] * len(lens), share, capacity, device, seed=len(lens))
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype).to(
        device)
    scale = d ** -0.5
    indices, mask = reference.decode_indices(table, rows, lens)
    want = reference.decode_attention(q, k, v, indices, mask, scale)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    got = decode_attention(q, k, v, table, i32(rows), i32(lens), scale, block_n=16)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_match_reference(device, dtype):
    g = torch.Generator().manual_seed(3)
    # store_kv: strided [T, Hkv, D] views, as the model's split QKV projection produces them
    kv = torch.randn(9, 3 * 2 * 16, generator=g).to(dtype).to(device)
    k_new = kv[:, 32:64].view(9, 2, 16)
    v_new = kv[:, 64:].view(9, 2, 16)
    loc = torch.tensor([7, 3, 50, 1, 9, 22, 8, 40, 41], device=device)
    kb, vb = pool(64, 2, 16, dtype, device)
    kr, vr = kb.clone(), vb.clone()
    fused.store_kv(k_new, v_new, kb, vb, loc)
    kr[loc], vr[loc] = k_new, v_new
    assert torch.equal(kb, kr) and torch.equal(vb, vr)
    # ... and into head-major pools (TokenKVPool's layout on a CPU: strided heads)
    kh, vh = (torch.zeros(2, 64, 16, dtype=dtype, device=device).permute(1, 0, 2) for _ in "kv")
    fused.store_kv(k_new, v_new, kh, vh, loc)
    assert torch.equal(kh[loc], k_new) and torch.equal(vh[loc], v_new)
    assert int((kh != 0).any(dim=(1, 2)).sum()) == len(loc)  # no other slot written
    # RMSNorm over rows of a wider tensor, and RoPE on a strided view
    x = torch.randn(5, 96, generator=g).to(dtype).to(device)
    w = torch.randn(96, generator=g).to(dtype).to(device)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype])
    qkv = torch.randn(5, 4 * 32 + 2 * 32, generator=g).to(dtype).to(device)
    q = qkv[:, :128].view(5, 4, 32)
    angles = torch.randn(5, 16, generator=g)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype).to(device)
    torch.testing.assert_close(fused.apply_rope(q, cos, sin), reference.apply_rope(q, cos, sin),
                               atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("name", ["triton", pytest.param("flashinfer", marks=pytest.mark.gpu)])
def test_backend_matches_reference_backend_over_passes(device, name):
    """A prefill (one sequence with a cached prefix, one without) then two decode steps through
    the backend objects; the fast and the reference backend keep identical pools and outputs.
    (FlashInfer: only where it is installed and a GPU is present.)"""
    if name == "flashinfer":
        pytest.importorskip("flashinfer")
        if device != "cuda":
            pytest.skip("FlashInfer needs a GPU")
        from kernels.flashinfer import FlashInferAttention as Fast
    else:
        Fast = TritonAttention
    d, hq, hkv, capacity = 64, 6, 2, 256  # FlashInfer supports head_dim 64/128/256
    pools = {name: pool(capacity, hkv, d, torch.float32, device) for name in ("ref", "tri")}
    if name == "flashinfer":  # FlashInfer runs fp16/bf16 only
        pools = {n: (k.half(), v.half()) for n, (k, v) in pools.items()}
    backends = {"ref": ReferenceAttention([pools["ref"][0]], [pools["ref"][1]]),
                "tri": Fast([pools["tri"][0]], [pools["tri"][1]])}
    dtype = pools["ref"][0].dtype
    tol = TOL[dtype]
    table = torch.zeros(4, 64, dtype=torch.int64, device=device)
    table[1, :40] = torch.arange(100, 140)
    table[3, :40] = torch.arange(150, 190)
    g = torch.Generator().manual_seed(5)
    for prefix, extend in (([12, 0], [20, 9]), ([32, 9], [1, 1]), ([33, 10], [1, 1])):
        loc = torch.cat([table[1, prefix[0]:prefix[0] + extend[0]],
                         table[3, prefix[1]:prefix[1] + extend[1]]])
        inputs = AttentionInputs(is_decode=extend == [1, 1], req_to_token=table, req_rows=[1, 3],
                                 prefix_lens=prefix, extend_lens=extend, out_cache_loc=loc)
        t = sum(extend)
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype).to(device)
                   for h in (hq, hkv, hkv))
        outs = {}
        for name, backend in backends.items():
            backend.begin(inputs)
            backend.store_kv(0, k, v)
            outs[name] = backend.attend(0, q, d ** -0.5)
        torch.testing.assert_close(outs["tri"].float(), outs["ref"].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pools["tri"][0], pools["ref"][0])


@pytest.mark.parametrize("dtype", [torch.float32,  # bfloat16's casts: tested above everywhere
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("window, softcap", [(8, 0.0), (0, 2.0), (20, 3.0), (1, 0.0)])
def test_sliding_window_and_softcap_match_reference(device, dtype, window, softcap):
    """Window layers (positions (p - W, p]) and soft-capped scores, for extend over cached
    prefixes longer and shorter than the window, and for decode."""
    prefix_lens, extend_lens = [5, 33, 0, 64], [1, 3, 37, 2]
    hq, hkv, d, capacity = 6, 2, 32, 512
    k, v = pool(capacity, hkv, d, dtype, device, seed=7)
    table, rows = slot_rows(prefix_lens, extend_lens, False, capacity, device, seed=7)
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(sum(extend_lens), hq, d, generator=g) * 3).to(dtype).to(device)
    scale = d ** -0.5
    want = reference.extend_attention(q, k, v, table, rows, prefix_lens, extend_lens, scale,
                                      window, softcap)
    starts = torch.tensor([sum(extend_lens[:i]) for i in range(len(rows))], dtype=torch.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    # block_m > block_n: late rows of a query block see nothing in its first KV blocks
    for block_m, block_n in ((16, 16), (32, 16)):
        got = extend_attention(q, k, v, table, i32(rows), i32(prefix_lens), i32(extend_lens),
                               starts.to(device), max(extend_lens), scale, block_m=block_m,
                               block_n=block_n, window=window, softcap=softcap)
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    qd = q[:len(lens)]
    indices, mask = reference.decode_indices(table, rows, lens, window)
    want = reference.decode_attention(qd, k, v, indices, mask, scale, softcap)
    got = decode_attention(qd, k, v, table, i32(rows), i32(lens), scale, block_n=16,
                           window=window, softcap=softcap)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_reference_window_equals_masked_full_attention():
    """The reference's windowed gather (only the last W rows) equals full attention with the
    window applied as a mask, for extend and decode."""
    d, w = 16, 6
    k, v = pool(64, 2, d, torch.float32, "cpu", seed=9)
    table = torch.arange(64).view(1, 64)
    q = torch.randn(10, 4, d, generator=torch.Generator().manual_seed(9))
    got = reference.extend_attention(q, k, v, table, [0], [15], [10], d ** -0.5, w)
    kk = k[:25].repeat_interleave(2, 1).transpose(0, 1)  # [4, 25, d]
    vv = v[:25].repeat_interleave(2, 1).transpose(0, 1)
    pos = torch.arange(15, 25)[:, None]
    cols = torch.arange(25)[None, :]
    s = (q.transpose(0, 1) @ kk.transpose(1, 2)) * d ** -0.5
    s = s.masked_fill(~((cols <= pos) & (cols > pos - w)), float("-inf"))
    want = (s.softmax(-1) @ vv).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    indices, mask = reference.decode_indices(table, [0], [25], w)
    assert indices.shape == (1, w) and indices[0].tolist() == list(range(19, 25))
    got = reference.decode_attention(q[-1:], k, v, indices, mask, d ** -0.5)
    torch.testing.assert_close(got, want[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 5])
def test_reference_backend_mixed_batch_equals_per_sequence_extend(window):
    """A mixed extend batch (prefill chunks with 1-token decodes between and after them) gives
    the decodes the batched decode path and the chunks the per-sequence path: together equal
    to per-sequence extend attention over the whole batch."""
    d = 16
    k, v = pool(128, 2, d, torch.float32, "cpu", seed=3)
    table = torch.arange(128).view(4, 32)
    rows, prefix, lens = [0, 1, 2, 3], [9, 0, 20, 4], [1, 7, 1, 1]
    q = torch.randn(sum(lens), 4, d, generator=torch.Generator().manual_seed(3))
    want = reference.extend_attention(q, k, v, table, rows, prefix, lens, d ** -0.5, window)
    backend = reference.ReferenceAttention([k], [v])
    backend.begin(AttentionInputs(is_decode=False, req_to_token=table, req_rows=rows,
                                  prefix_lens=prefix, extend_lens=lens,
                                  out_cache_loc=torch.zeros(sum(lens), dtype=torch.int64)))
    assert backend._mixed is not None
    got = backend.attend(0, q, d ** -0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
