"""The AVX-512 VNNI linear kernels (kernels/cpu/csrc_vnni) against a float64 emulation of
their int8-activation arithmetic, against the float product, and their batch invariance: a
row's result is bitwise the same alone or in any batch. Skipped where the CPU lacks VNNI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu as native
from server.model.quantization import QuantLinear, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not native.available("avx512_vnni"),
                                reason=f"VNNI kernels: {native.unavailable_reason('avx512_vnni')}")


def _quantize_rows(x: torch.Tensor):
    """The kernel's activation quantization, emulated: per row and block of 32, float32
    amax, dx = amax / 127, q = round-half-even(x * (127 / amax)) clamped to [-127, 127]."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q, amax / 127  # [m, G, 32] integers as float32, [m, G]


def _int4_reference(x: torch.Tensor, qw) -> torch.Tensor:
    """y = sum_b dx_b * (d_b * sum q qx + m_b * sum qx), in float64, with the fp16 d and m the
    packed weight keeps."""
    q, dx = _quantize_rows(x)
    n, k = qw.q.shape
    d = qw.scale.half().double()  # [n, G]
    m = (qw.zero - 8 * qw.scale).half().double()
    wq = qw.q.double().view(n, k // 32, 32)
    isum = torch.einsum("mgk,ngk->mng", q.double(), wq)  # exact integers
    sx = q.double().sum(-1)  # [m, G]
    dxd = dx.double()
    return (dxd[:, None, :] * (d[None] * isum + m[None] * sx[:, None, :])).sum(-1)


def _int8_reference(x: torch.Tensor, q8) -> torch.Tensor:
    q, dx = _quantize_rows(x)
    n, k = q8.q.shape
    isum = torch.einsum("mgk,ngk->mng", q.double(), q8.q.double().view(n, k // 32, 32))
    return (isum * dx.double()[:, None, :]).sum(-1) * q8.scale.double()[None]


def _assert_batch_invariant(fn, x: torch.Tensor, y: torch.Tensor) -> None:
    rows = torch.cat([fn(x[i:i + 1].contiguous()) for i in range(x.shape[0])])
    assert torch.equal(y, rows)  # each row alone gives the same bits as in the batch
    if x.shape[0] > 2:
        shuffled = torch.randperm(x.shape[0])
        assert torch.equal(fn(x[shuffled].contiguous()), y[shuffled])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 5, 17, 64, 131])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (130, 96), (96, 576)])
def test_int4_matches_the_int8_activation_arithmetic_and_is_batch_invariant(m, n, k, dtype):
    torch.manual_seed(n + k + m)
    qw = quantize_int4(torch.randn(n, k))
    packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
    x = torch.randn(m, k).to(dtype)
    fn = lambda a: native.vnni_int4_linear(a, packed, n)  # noqa: E731
    y = fn(x)
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.bfloat16:  # the in-register rounding is Tensor.to's, bit for bit
        assert torch.equal(y, fn(x.float()).to(torch.bfloat16))
    ref = _int4_reference(x, qw)
    # float32 accumulation of exact block sums; bfloat16 outputs round to 8 bits
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < tol
    # int8 activations: about 1% of the float product's scale at most
    full = x.float() @ qw.dequantize().T
    assert ((y.float() - full).abs().max() / full.abs().max()) < 2e-2
    _assert_batch_invariant(fn, x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5, 7, 67])
@pytest.mark.parametrize("i,k", [(16, 32), (48, 96), (80, 576)])
def test_fused_gate_up_silu_is_bitwise_the_unfused_pair(m, i, k, dtype):
    """int4_linear_silu gives the bits of silu_mul(int4_linear(x)) (what the decoder stack ran
    before fusing them), row by row whatever the batch; I not a multiple of 16 is refused."""
    torch.manual_seed(m + i + k)
    qw = quantize_int4(torch.randn(2 * i, k))
    packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
    x = (2 * torch.randn(m, k)).to(dtype)
    fn = lambda a: native.vnni_int4_linear_silu(a, packed, 2 * i)  # noqa: E731
    y = fn(x)
    assert y.dtype == dtype and y.shape == (m, i)
    unfused = torch.ops.sgl_cpu_vnni.silu_mul(native.vnni_int4_linear(x, packed, 2 * i))
    assert torch.equal(y, unfused)
    gate, up = (x.double() @ qw.dequantize().double().T).split(i, dim=1)
    ref = torch.nn.functional.silu(gate) * up
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 3e-2  # int8 activations
    _assert_batch_invariant(fn, x, y)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.vnni_int4_linear_silu(x, native.vnni_pack_int4(*_q4_parts(2 * i + 16, k)),
                                     2 * i + 16)


_ROUNDING_SCRIPT = """
import sys, torch
from kernels import cpu as native
from server.model.quantization import quantize_int4
ops = torch.ops.sgl_cpu_vnni
torch.manual_seed(7)
qw = quantize_int4(torch.randn(2 * 80, 576))
packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
x = (3 * torch.randn(67, 576)).to(torch.bfloat16)
x[0, :5] = torch.tensor([0.0, -0.0, 1e-3, 60.0, -60.0])
out = {"silu": native.vnni_int4_linear_silu(x, packed, 2 * 80)}
w = torch.randn(576).to(torch.bfloat16)
out["norm"] = ops.rms_norm(x, w, 1e-5)
residual = torch.randn(67, 576).to(torch.bfloat16)
out["add_norm"] = ops.add_rms_norm(x, residual, w, 1e-5)
out["residual"] = residual
qkv = torch.randn(5, (9 + 2 * 3) * 64).to(torch.bfloat16)
angle = torch.arange(5)[:, None] * torch.rand(64)
k_buf, v_buf = torch.zeros(8, 3, 64, dtype=torch.bfloat16), torch.zeros(8, 3, 64, dtype=torch.bfloat16)
ops.rope_store(qkv, angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16), 9, 3, 64,
               k_buf, v_buf, torch.tensor([3, 0, 7, 1, 5]))
out["rope"], out["k"] = qkv, k_buf
torch.save(out, sys.argv[1])
"""


def test_native_bf16_rounding_gives_the_emulations_bits(tmp_path):
    """On an AVX512-BF16 CPU the fused gate/up tile, the norms and RoPE round to bf16 by the
    CPU's conversion, elsewhere (or with SGL_CPU_ISA below avx512_bf16) by the integer
    emulation: the same bits for normal values. Each process decides once, so each rounding
    runs in its own."""
    outs = []
    for isa in ("", "avx512_vnni"):
        path = tmp_path / f"rounding_{isa or 'default'}.pt"
        env = {**os.environ, "SGL_CPU_ISA": isa}
        subprocess.run([sys.executable, "-c", _ROUNDING_SCRIPT, str(path)], check=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                       timeout=120)
        outs.append(torch.load(path))
    assert outs[0].keys() == outs[1].keys() == {"silu", "norm", "add_norm", "residual", "rope", "k"}
    for name, got in outs[0].items():
        assert got.dtype == torch.bfloat16 and torch.equal(got, outs[1][name]), name


def _q4_parts(n: int, k: int):
    qw = quantize_int4(torch.randn(n, k))
    return qw.q, qw.scale, qw.zero


@pytest.mark.parametrize("m", [1, 4, 7, 70])
@pytest.mark.parametrize("n,k", [(50, 96), (16, 32), (300, 576)])
def test_int8_matches_the_int8_activation_arithmetic_and_is_batch_invariant(m, n, k):
    torch.manual_seed(m * n)
    q8 = quantize_int8(torch.randn(n, k))
    packed = native.vnni_pack_int8(q8.q)
    scale = q8.scale.float().contiguous()
    x = torch.randn(m, k)
    fn = lambda a: native.vnni_int8_linear(a, packed, scale)  # noqa: E731
    y = fn(x)
    ref = _int8_reference(x, q8)
    assert y.shape == (m, n) and ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    _assert_batch_invariant(fn, x, y)


def test_zero_and_extreme_rows():
    """A row of zeros gives zeros (no 0/0 scale); a block with one huge value keeps it."""
    torch.manual_seed(3)
    qw = quantize_int4(torch.randn(32, 64))
    packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
    x = torch.zeros(3, 64)
    x[1, 5] = 1e30
    x[2] = torch.randn(64)
    y = native.vnni_int4_linear(x, packed, 32)
    assert torch.equal(y[0], torch.zeros(32)) and torch.isfinite(y).all()
    ref = _int4_reference(x, qw)
    assert ((y.double() - ref).abs().max(-1).values / ref.abs().max(-1).values)[1:].max() < 1e-5


def test_bad_shapes_are_errors_not_crashes():
    qw = quantize_int4(torch.randn(32, 64))
    packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
    with pytest.raises(RuntimeError, match="must be"):
        native.vnni_int4_linear(torch.randn(2, 63), packed, 32)
    with pytest.raises(RuntimeError, match="packed"):
        native.vnni_int4_linear(torch.randn(2, 64), packed, 40)  # 3 tiles expected, 2 given
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.vnni_int4_linear(torch.randn(2, 64).half(), packed, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.vnni_pack_int8(torch.zeros(16, 40, dtype=torch.int8))
    packed8 = native.vnni_pack_int8(torch.zeros(16, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scale"):
        native.vnni_int8_linear(torch.randn(2, 64), packed8, torch.ones(16, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quant_linear_on_the_vnni_kernel(kind):
    """QuantLinear(native="avx512_vnni"): 2-D/3-D and strided inputs, the input's dtype,
    the bias, and the same values as the kernel."""
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    qw = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    bias = torch.randn(48)
    layer = QuantLinear(qw, bias, native="avx512_vnni")
    x = torch.randn(6, 64)
    y = layer(x)
    full = x @ qw.dequantize().T + bias
    assert y.dtype == torch.float32 and (y - full).abs().max() <= 2e-2 * full.abs().max()
    assert torch.equal(layer(x.view(2, 3, 64)), y.view(2, 3, 48))
    strided = torch.randn(64, 6).T
    assert torch.equal(layer(strided), layer(strided.contiguous()))
    for dtype in (torch.bfloat16, torch.float16):
        assert layer(x.to(dtype)).dtype == dtype
    assert "native=avx512_vnni" in layer.extra_repr()


def test_a_tied_int8_embedding_reads_its_rows_from_the_heads_vnni_layout():
    """One copy of a tied int8 weight: the lookup gathers rows out of the packed head and
    gives the values of the plain int8 embedding."""
    from server.model.quantization import QuantEmbedding

    torch.manual_seed(2)
    q8 = quantize_int8(torch.randn(70, 96))
    vnni = QuantEmbedding(q8, torch.float32, tied=True, native="avx512_vnni")
    plain = QuantEmbedding(q8, torch.float32, tied=True, native=None)
    ids = torch.tensor([0, 5, 69, 17, 16, 5, 64])
    assert vnni.q is None and torch.equal(vnni(ids), plain(ids))
    assert torch.equal(native.vnni_int8_rows(vnni.as_linear.packed, ids, 96), q8.q[ids])
