"""Weight-only quantization without a model: GGUF block types against the ``gguf`` package's own
dequantization, the packed CPU matmuls against a float matmul of the same weights, and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu as native_kernels
from server.config import ConfigError, ModelConfig
from server.model.quantization import (
    QuantEmbedding,
    QuantizationError,
    QuantLinear,
    gguf_int4,
    quantize_int4,
    quantize_int8,
)

N, K = 48, 256  # rows, weights per row (K a multiple of 256 for the K-quants)


def _weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    w[3] *= 20  # a row with a much larger range
    return w


def _random_kquant_blocks(type_name: str, seed: int = 0) -> np.ndarray:
    """Raw bytes of a K-quant tensor: random codes, small valid fp16 super-block scales (the
    gguf package cannot quantize K-quants, only read them)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N * K // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-2, (N * K // block, 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":  # d, dmin lead the block
        raw[:, 0:4] = scales.reshape(-1, 4)
    else:  # Q6_K: d is the last 2 bytes
        raw[:, -2:] = scales[:, :2]
    return raw.reshape(N, -1)


def _gguf_data(type_name: str) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_K", "Q6_K"):
        return _random_kquant_blocks(type_name)
    return gguf.quants.quantize(_weights(), qtype)


def _reference(data: np.ndarray, type_name: str) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
                            .astype(np.float32)).reshape(N, K)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_types_are_kept_exactly_as_int4(type_name):
    data = _gguf_data(type_name)
    ref = _reference(data, type_name)
    qw = gguf_int4(data, type_name, (N, K))
    assert qw.kind == "int4" and qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15
    assert qw.scale.shape == qw.zero.shape == (N, K // 32)
    # Same numbers up to float32 rounding of (q - 8) * scale + zero vs the file's formula.
    assert (qw.dequantize() - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q5_1", "Q6_K"])
def test_wider_gguf_types_become_per_channel_int8_within_half_a_step(type_name):
    ref = _reference(_gguf_data(type_name), type_name)
    qw = quantize_int8(ref, f"{type_name} -> int8")
    err = (qw.dequantize() - ref).abs().amax(dim=1)
    assert torch.all(err <= qw.scale / 2 * (1 + 1e-5) + 1e-12)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (N,)


def test_gguf_int4_names_supported_types():
    with pytest.raises(QuantizationError, match="Q8_0.*Q4_0, Q4_1, Q4_K"):
        gguf_int4(np.zeros((N, 10), np.uint8), "Q8_0", (N, K))


def _linear_ref(x, qw, bias=None):
    return F.linear(x, qw.dequantize(), bias)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_quant_linear_matches_float_matmul_of_the_same_weights(kind, rows):
    torch.manual_seed(0)
    w = torch.from_numpy(_weights())
    qw = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    bias = torch.randn(N)
    layer = QuantLinear(qw, bias)
    x = torch.randn(rows, K)
    y, ref = layer(x), _linear_ref(x, qw, bias)
    assert y.dtype == torch.float32 and y.shape == (rows, N)
    # bf16 activations (8-bit mantissa), fp32 accumulation inside the op
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(x.view(1, rows, K)).shape == (1, rows, N)


@pytest.mark.skipif(not native_kernels.available(),
                    reason=f"sgl_cpu kernels: {native_kernels.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_native_quant_linear_takes_any_float_input_shape_and_layout(kind):
    """The native path (kernels.cpu) on 2-D and 3-D, contiguous and strided, float32, bfloat16
    and float16 inputs: the same values as the float product, the input's dtype and shape."""
    torch.manual_seed(0)
    w = torch.from_numpy(_weights())
    qw = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    bias = torch.randn(N)
    layer = QuantLinear(qw, bias, native=True)
    x = torch.randn(6, K)
    ref = _linear_ref(x, qw, bias)
    y = layer(x)
    tol = 2e-3 if kind == "int4" else 1e-4  # int4 scales and offsets are packed as fp16
    assert y.dtype == torch.float32 and (y - ref).abs().max() <= tol * ref.abs().max()
    assert torch.equal(layer(x.view(2, 3, K)), y.view(2, 3, N))
    strided = torch.randn(K, 6).T  # not contiguous
    assert torch.equal(layer(strided), layer(strided.contiguous()))
    for dtype in (torch.bfloat16, torch.float16):
        out = layer(x.to(dtype))
        assert out.dtype == dtype and out.shape == (6, N)
        assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_long_inputs_use_the_dense_bf16_copy_short_ones_the_packed_weight():
    qw = quantize_int4(torch.from_numpy(_weights()))
    layer = QuantLinear(qw, dense_min_rows=8)
    packed_only = QuantLinear(qw)
    assert layer.dense.dtype == torch.bfloat16 and packed_only.dense is None
    short, long = torch.randn(7, K), torch.randn(8, K)
    assert torch.equal(layer(short), packed_only(short))
    dense_ref = F.linear(long.bfloat16(), qw.dequantize().bfloat16()).float()
    assert torch.equal(layer(long), dense_ref)
    assert layer.nbytes == packed_only.nbytes + N * K * 2


def test_quant_linear_keeps_its_packed_dtype_through_module_to():
    layer = QuantLinear(quantize_int4(torch.from_numpy(_weights())))
    x = torch.randn(3, K)
    before = layer(x)
    layer.to(torch.float32)
    assert layer.scales_and_zeros.dtype == torch.bfloat16
    assert torch.equal(layer(x), before)


def test_int4_needs_packable_shapes():
    with pytest.raises(QuantizationError, match="out_features % 16"):
        QuantLinear(quantize_int4(torch.randn(40, 64)))
    with pytest.raises(QuantizationError, match="divisible by 32"):
        quantize_int4(torch.randn(48, 40))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quant_embedding_rows_equal_the_dequantized_weight(kind):
    w = torch.from_numpy(_weights())
    qw = quantize_int4(w) if kind == "int4" else quantize_int8(w)
    emb = QuantEmbedding(qw, torch.float32, tied=True)
    ids = torch.tensor([0, 3, 3, N - 1])
    assert torch.equal(emb(ids), qw.dequantize()[ids])
    x = torch.randn(2, K)
    ref = _linear_ref(x, qw)
    assert (emb.as_linear(x) - ref).abs().max() <= 2e-2 * ref.abs().max()
    if kind == "int8":  # the tied head shares the int8 tensor instead of a second copy
        assert emb.as_linear.packed.data_ptr() == emb.q.data_ptr()


def test_config_names_the_quantization_modes():
    with pytest.raises(ConfigError, match="quantization must be one of"):
        ModelConfig(quantization="int3")
    assert ModelConfig().quantization == "auto"


def test_cli_quantization_flag(capsys):
    from server.__main__ import build_parser, configs_from_args

    args = build_parser().parse_args(["--quantization", "int8", "--enable-torch-compile"])
    engine, _ = configs_from_args(args)
    assert engine.model.quantization == "int8" and engine.model.torch_compile
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--quantization", "nf4"])
    assert "invalid choice: 'nf4'" in capsys.readouterr().err


@pytest.mark.parametrize("fn", [quantize_int4, quantize_int8])
def test_quantizing_in_row_chunks_gives_the_whole_tensors_bits(fn, monkeypatch):
    """Weights are quantized QUANTIZE_ROWS rows at a time (a 128k-row embedding held several
    1 GB float32 temporaries); the chunks' results are the whole tensor's, bit for bit."""
    import server.model.quantization as quant

    w = torch.randn(37, 64, dtype=torch.bfloat16) * 3
    w[5] = 0  # an all-zero row (scale 0) inside a chunk
    whole = fn(w)
    monkeypatch.setattr(quant, "QUANTIZE_ROWS", 4)
    chunked = fn(w)
    for a, b in zip((whole.q, whole.scale, whole.zero), (chunked.q, chunked.scale, chunked.zero)):
        assert (a is None and b is None) or torch.equal(a, b)
