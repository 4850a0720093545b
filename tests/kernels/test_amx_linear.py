"""The AMX int4 linear kernel (kernels/cpu/csrc_vnni/amx_linear.cpp) against the float product
of its bf16-rounded weights, its rows' independence from the batch, the thread count and the
input dtype, its errors, and QuantLinear's choice of it over dense bf16 copies. Skipped where
the CPU (or the OS) gives no AMX tiles."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu as native
from server.model.quantization import QuantLinear, quantize_int4

pytestmark = pytest.mark.skipif(not native.amx_available(),
                                reason="no AMX-BF16 tiles here (or SGL_CPU_AMX=0)")


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qw = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
    # what the kernel dequantizes: the packed fp16 d and m, w = d * q + m, rounded to bf16
    d = qw.scale.half().float().repeat_interleave(32, dim=1)
    m = (qw.zero - 8 * qw.scale).half().float().repeat_interleave(32, dim=1)
    w = (d * qw.q.float() + m).bfloat16().float()
    return qw, packed, w


@pytest.mark.parametrize("k,n", [(32, 16), (64, 80), (576, 960), (1536, 576), (96, 40)])
def test_amx_int4_linear_is_the_product_of_its_bf16_weights(k, n):
    """Odd tile counts (80 = 5 tiles), a partial last tile (40), row counts around the 32-row
    step: within float32-sum and bf16-output rounding of x @ w.T."""
    _, packed, w = _weights(n, k, seed=k + n)
    g = torch.Generator().manual_seed(1)
    for m in (1, 15, 16, 17, 32, 33, 100):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = native.amx_int4_linear(x, packed, n)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        ref = x.float() @ w.T
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_a_row_is_the_same_alone_in_any_batch_on_any_thread_count():
    _, packed, _ = _weights(960, 576, seed=3)
    x = torch.randn(77, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = native.amx_int4_linear(x, packed, 960)
    for i in (0, 31, 32, 64, 76):  # first and last of a step, and the zero-padded tail step
        assert torch.equal(native.amx_int4_linear(x[i:i + 1].contiguous(), packed, 960)[0], y[i])
    assert torch.equal(native.amx_int4_linear(x[40:].contiguous(), packed, 960), y[40:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.amx_int4_linear(x, packed, 960), y)
    finally:
        torch.set_num_threads(threads)


def test_float32_input_is_rounded_to_bf16_first():
    _, packed, _ = _weights(48, 64, seed=4)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))
    y32 = native.amx_int4_linear(x, packed, 48)
    y16 = native.amx_int4_linear(x.bfloat16(), packed, 48)
    assert y32.dtype == torch.float32
    assert torch.equal(y32.bfloat16(), y16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_gate_up_silu_is_bitwise_silu_mul_of_the_linear(dtype):
    """Gate and up tiles side by side (I = 48: three tiles each, an odd pair count), row counts
    around the 32-row step: the same bits as the unfused linear and the SiLU op."""
    _, packed, _ = _weights(96, 128, seed=8)
    g = torch.Generator().manual_seed(9)
    for m in (1, 31, 32, 33, 100):
        x = torch.randn(m, 128, generator=g).to(dtype)
        fused = native.amx_int4_linear_silu(x, packed, 96)
        unfused = torch.ops.sgl_cpu_vnni.silu_mul(native.amx_int4_linear(x, packed, 96))
        assert fused.shape == (m, 48) and fused.dtype == dtype
        assert torch.equal(fused, unfused)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.amx_int4_linear_silu(torch.randn(4, 128).bfloat16(), _weights(80, 128, seed=1)[1], 80)


def test_bad_inputs_are_errors_not_crashes():
    _, packed, _ = _weights(48, 64, seed=6)
    with pytest.raises(RuntimeError, match="packed must be"):
        native.amx_int4_linear(torch.randn(4, 64).bfloat16(), packed, 96)
    with pytest.raises(RuntimeError, match="packed must be"):  # K of another weight
        native.amx_int4_linear(torch.randn(4, 32).bfloat16(), packed, 48)
    with pytest.raises(RuntimeError, match="a multiple of 32"):
        native.amx_int4_linear(torch.randn(4, 65).bfloat16(), packed, 48)
    with pytest.raises(RuntimeError, match="x must be"):
        native.amx_int4_linear(torch.randn(4, 64).half(), packed, 48)
    assert native.amx_int4_linear(torch.empty(0, 64).bfloat16(), packed, 48).shape == (0, 48)


def test_quant_linear_runs_long_inputs_on_amx_and_keeps_no_dense_copy(monkeypatch):
    """dense_min_rows on the VNNI kernel: inputs of that many rows go to the AMX kernel, fewer
    to the VNNI one, and no bf16 copy is kept; with SGL_CPU_AMX=0 the copy is back."""
    qw, packed, _ = _weights(96, 64, seed=7)
    layer = QuantLinear(qw, dense_min_rows=64, native="avx512_vnni")
    assert layer.amx and layer.dense is None
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(8)).bfloat16()
    assert torch.equal(layer(x), native.amx_int4_linear(x, packed, 96))
    assert torch.equal(layer(x[:63]), native.vnni_int4_linear(x[:63], packed, 96))
    monkeypatch.setenv(native.AMX_OVERRIDE, "0")
    copied = QuantLinear(qw, dense_min_rows=64, native="avx512_vnni")
    assert not copied.amx and copied.dense is not None
