"""The native CPU kernels (kernels/cpu) against the pure-torch reference on random inputs, and
their batch invariance: a row's result is bitwise the same alone or in any batch. The CPU class
probe, the linear layers, norms, SiLU, sampling and LoRA here; attention and RoPE + K/V store:
test_cpu_attention.py."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu as native
from kernels import reference
from kernels.cpu_features import (
    ISA_LEVELS,
    at_least,
    cpu_description,
    cpu_isa,
    isa_from_flags,
    native_bf16,
)
from server.model.quantization import quantize_int4, quantize_int8

needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"sgl_cpu kernels: {native.unavailable_reason()}")


def test_isa_levels_from_flags_and_the_override(monkeypatch):
    assert isa_from_flags({"avx", "fma"}) == "none"
    assert isa_from_flags({"avx2", "fma", "avx512f"}) == "avx2"  # no avx512bw/vl: still avx2
    assert isa_from_flags({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}) == "avx512"
    icelake = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert isa_from_flags(icelake) == "avx512_vnni" and not native_bf16("avx512_vnni")
    zen4 = icelake | {"avx512_bf16"}
    assert isa_from_flags(zen4) == "avx512_bf16" and native_bf16(isa_from_flags(zen4))
    spr = zen4 | {"amx_bf16", "amx_int8", "amx_tile"}
    assert isa_from_flags(spr) == "amx"
    assert isa_from_flags({"amx_bf16", "amx_int8", "amx_tile"}) == "none"  # levels are ordered
    for level in ISA_LEVELS:
        monkeypatch.setenv("SGL_CPU_ISA", level)
        assert cpu_isa() == level
    monkeypatch.setenv("SGL_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="SGL_CPU_ISA"):
        cpu_isa()
    assert at_least("avx2", "amx") and not at_least("avx512", "avx2")


def test_cpu_description_names_the_model_class_and_deciding_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl "
                    "avx512_vnni avx512_bf16 amx_bf16 amx_int8 amx_tile\n")
    line = cpu_description(str(info))
    assert line.startswith("Intel(R) Xeon(R) Platinum 8480+; class amx (")
    assert "amx_tile" in line and "avx512_bf16" in line and "sse2" not in line
    assert "class none (no AVX)" in cpu_description(str(tmp_path / "missing"))


def _int4(n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    qw = quantize_int4(torch.randn(n, k))
    return qw, native.pack_int4(qw.q, qw.scale, qw.zero)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 7, 16, 61, 130])
@pytest.mark.parametrize("n,k", [(96, 64), (7, 32), (130, 96)])
def test_int4_linear_matches_the_dequantized_weight_and_is_batch_invariant(m, n, k, dtype):
    qw, packed = _int4(n, k)
    x = torch.randn(m, k).to(dtype)
    y = native.int4_linear(x, packed, n)
    ref = x.float() @ qw.dequantize().T  # fp16 block scales: a few 1e-4 relative
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    assert ((y.float() - ref).abs().max() / ref.abs().max()) < tol
    rows = torch.cat([native.int4_linear(x[i:i + 1].contiguous(), packed, n) for i in range(m)])
    assert torch.equal(y, rows)  # each row alone gives the same bits as in the batch
    if m > 2:
        shuffled = torch.randperm(m)
        assert torch.equal(native.int4_linear(x[shuffled].contiguous(), packed, n), y[shuffled])


@needs_native
@pytest.mark.parametrize("m", [1, 6, 7, 64])
def test_int8_linear_matches_and_is_batch_invariant(m):
    torch.manual_seed(1)
    q8 = quantize_int8(torch.randn(50, 96))
    x = torch.randn(m, 96)
    y = native.int8_linear(x, q8.q, q8.scale)
    ref = x @ q8.dequantize().T
    assert (y - ref).abs().max() < 1e-4 * ref.abs().max()
    rows = torch.cat([native.int8_linear(x[i:i + 1].contiguous(), q8.q, q8.scale)
                      for i in range(m)])
    assert torch.equal(y, rows)


@needs_native
def test_bad_shapes_are_errors_not_crashes():
    _, packed = _int4(32, 64)
    with pytest.raises(RuntimeError, match="must be"):
        native.int4_linear(torch.randn(2, 63), packed, 32)
    with pytest.raises(RuntimeError, match="packed"):
        native.int4_linear(torch.randn(2, 64), packed, 31)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native.int4_linear(torch.randn(2, 64).half(), packed, 32)


@needs_native
@pytest.mark.parametrize("library", ["sgl_cpu", "sgl_cpu_vnni"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_match_the_reference_and_are_row_invariant(library, dtype):
    """rms_norm and add_rms_norm (residual += x in place, rounded to the dtype, then the norm
    of the sum) against the reference, for widths with and without a vector tail; a row alone
    gives the same bits as in the batch."""
    if library == "sgl_cpu_vnni" and not native.available("avx512_vnni"):
        pytest.skip(native.unavailable_reason("avx512_vnni"))
    ops = getattr(torch.ops, library)
    torch.manual_seed(4)
    for width in (576, 100, 7):
        x, residual = (torch.randn(9, width) * 3).to(dtype), torch.randn(9, width).to(dtype)
        w = torch.randn(width).to(dtype)
        summed = (residual.float() + x.float()).to(dtype)
        r = residual.clone()
        got = ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(r, summed)
        want = reference.rms_norm(summed, w, 1e-5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        for y in (got, ops.rms_norm(summed, w, 1e-5)):
            assert y.dtype == dtype and y.shape == (9, width)
            assert ((y.float() - want.float()).abs() <= tol * (1 + want.float().abs())).all()
        assert torch.equal(ops.rms_norm(summed, w, 1e-5), got)
        assert torch.equal(ops.rms_norm(summed[4:5].contiguous(), w, 1e-5), got[4:5])
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)


@needs_native
@pytest.mark.parametrize("library", ["sgl_cpu", "sgl_cpu_vnni"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch_and_is_row_invariant(library, dtype):
    """silu(gate) rounded to the dtype, times up (torch's rounding points), for widths with and
    without a vector tail; a row alone gives the same bits as in the batch."""
    if library == "sgl_cpu_vnni" and not native.available("avx512_vnni"):
        pytest.skip(native.unavailable_reason("avx512_vnni"))
    op = getattr(torch.ops, library).silu_mul
    torch.manual_seed(3)
    for width in (1536, 40, 7):
        gate_up = (torch.randn(9, 2 * width) * 4).to(dtype)
        gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zeros
        gate, up = gate_up.float().chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate).to(dtype).float() * up
        got = op(gate_up)
        assert got.dtype == dtype and got.shape == (9, width)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert ((got.float() - want).abs() <= tol * (1 + want.abs())).all()
        assert torch.equal(op(gate_up[4:5].contiguous()), got[4:5])
    with pytest.raises(RuntimeError, match="float32 or bfloat16|2 I"):
        op(torch.randn(2, 3))


@needs_native
def test_the_attention_kernel_follows_the_cpu_class(make_tiny_model):
    """The fastest attention kernel the configured class allows and the machine runs;
    --cpu-isa avx2 / avx512_vnni keep the narrower ones (so each path can be tested on a bigger
    machine), and the decoder stack runs the one picked."""
    from kernels.cpu_features import at_least, detected_isa
    from server.engine import Engine

    path, _ = make_tiny_model("llama")
    for isa, kernel in [("avx2", "avx2"), ("avx512_vnni", "avx512_vnni"),
                        ("avx512_bf16", "avx512_bf16"), ("amx", "amx")]:
        if not (at_least(isa, detected_isa()) and native.available("avx512_vnni")) \
                and kernel != "avx2":
            continue
        if kernel == "amx" and not native.amx_available():
            continue
        engine = Engine(path, max_total_tokens=512, context_length=128, dtype="bfloat16",
                        quantization="int4", cpu_isa=isa)
        assert engine.runner.attention.kernel == kernel == native.attention_kernel(isa)
        assert engine.runner.model.native_stack is not None
        out = engine.generate(input_ids=[1, 5, 9], sampling_params={"max_new_tokens": 3,
                                                                  "temperature": 0})
        assert len(out["output_ids"]) == 3


@needs_native
def test_native_linear_layers_in_the_model_match_torchs(make_tiny_model):
    """A tiny model quantized to int4 (lm_head int8): the engine on the native kernels and on
    torch's packed ops agree on greedy tokens, and the report says which ran."""
    from server.engine import Engine

    path, _ = make_tiny_model("llama")
    native_engine = Engine(path, max_total_tokens=2048, context_length=256, dtype="float32",
                           quantization="int4")
    torch_engine = Engine(path, max_total_tokens=2048, context_length=256, dtype="float32",
                          quantization="int4", cpu_isa="none")
    assert "sgl_cpu" in native_engine.runner.quant_report.summary()
    assert "sgl_cpu" not in torch_engine.runner.quant_report.summary()
    assert torch_engine.config.model.attention_backend == "reference"
    assert native_engine.config.model.attention_backend == "cpu"
    ids = [1, 5, 9, 13, 2, 7]
    a = native_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8,
                                                               "temperature": 0})["output_ids"]
    b = torch_engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8,
                                                             "temperature": 0})["output_ids"]
    assert a[:4] == b[:4]  # torch's op computes in bf16: later tokens may drift


@needs_native
def test_a_forced_bf16_class_runs_the_bf16_paths_of_an_amx_machine(make_tiny_model):
    """cpu_isa="amx" on any AVX2 machine takes an AMX machine's decisions: bfloat16 compute
    (emulated here), the native kernels on bfloat16 activations and KV, and for long extends
    dense bf16 copies of the quantized weights (AMX bf16 tiles over the int4 weights where the
    CPU has them). Its greedy tokens start like float32's."""
    from server.engine import Engine

    path, _ = make_tiny_model("llama")
    amx = Engine(path, max_total_tokens=2048, context_length=256, quantization="int4",
                 cpu_isa="amx")
    ref = Engine(path, max_total_tokens=2048, context_length=256, quantization="int4",
                 cpu_isa="avx2")
    assert amx.config.model.dtype == "bfloat16" and ref.config.model.dtype == "float32"
    assert amx.config.model.attention_backend == "cpu"
    report = amx.runner.quant_report  # the dense bf16 extend copies, or AMX tiles
    assert (report.amx_modules > 0) == native.amx_available()
    assert (report.prefill_copy_bytes > 0) == (not native.amx_available())
    assert amx.kv_pool.k_buffers[0].dtype == torch.bfloat16
    params = {"max_new_tokens": 4, "temperature": 0}
    ids = list(range(5, 90))  # 85 tokens: the extend takes the dense copies' (AMX) path
    a = amx.generate(input_ids=ids, sampling_params=params)["output_ids"]
    b = ref.generate(input_ids=ids, sampling_params=params)["output_ids"]
    assert a[:2] == b[:2]


@needs_native
def test_sample_tempered_never_draws_a_masked_id_and_ignores_the_batch():
    """Across vocabulary sizes (with and without a partial last block and vector tail), masked
    logits and min-p, u at both ends of [0, 1): the drawn id has mass, and a row drawn alone
    gives the same id as in the batch; bad inputs are errors, not crashes."""
    op = torch.ops.sgl_cpu.sample_tempered
    g = torch.Generator().manual_seed(6)
    for vocab in (1, 13, 1024, 3000, 49152):
        x = torch.randn(6, vocab, generator=g) * 5
        x[torch.rand(6, vocab, generator=g) < 0.5] = float("-inf")
        x[:, 0] = 0.0  # some mass in every row
        inv_t = torch.rand(6, generator=g) * 3 + 0.2
        min_p = torch.tensor([0.0, 0.1, 0.0, 0.5, 0.0, 0.9])
        u = torch.rand(6, generator=g, dtype=torch.float64)
        u[0], u[1] = 0.0, 1.0 - 2.0**-53
        ids = op(x, inv_t, min_p, u)
        probs = torch.softmax(x * inv_t[:, None], dim=-1)
        kept = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        assert kept.gather(1, ids[:, None]).all() and (probs.gather(1, ids[:, None]) > 0).all()
        for r in range(6):
            assert op(x[r:r + 1], inv_t[r:r + 1], min_p[r:r + 1], u[r:r + 1]).item() == ids[r]
    with pytest.raises(RuntimeError, match="float32|float64"):
        op(torch.randn(2, 8), torch.ones(2), torch.zeros(2), torch.rand(2))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(64,), (37, 8, 8), (96, 45)])
def test_lora_sgmv_adds_each_rows_own_adapter_and_ignores_the_batch(dtype, widths):
    """lora_sgmv_ adds B_s A_s x to each row with slot s (parts side by side, widths that are
    not multiples of the 8- and 32-column blocks included) and leaves slot -1 rows as they
    were; a row's result is bitwise the same alone as among others."""
    g = torch.Generator().manual_seed(0)
    slots_n, rank, k, rows = 3, 4, 40, 7
    parts = len(widths)
    a = (torch.randn(slots_n * parts * rank, k, generator=g) / 4).to(dtype)
    bt = [(torch.randn(slots_n * rank, w, generator=g) / 4).to(dtype) for w in widths]
    x = torch.randn(rows, k, generator=g).to(dtype)
    y0 = torch.randn(rows, sum(widths), generator=g).to(dtype)
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    y = y0.clone()
    torch.ops.sgl_cpu.lora_sgmv_(y, x, slots, a, bt, rank)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            assert torch.equal(y[t], y0[t])
            continue
        h = a.float()[s * parts * rank:(s + 1) * parts * rank] @ x[t].float()
        add = torch.cat([h[p * rank:(p + 1) * rank] @ bt[p].float()[s * rank:(s + 1) * rank]
                         for p in range(parts)])
        want = y0[t].float() + add
        assert torch.allclose(y[t].float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
        alone = y0[t:t + 1].clone()
        torch.ops.sgl_cpu.lora_sgmv_(alone, x[t:t + 1].contiguous(), slots[t:t + 1], a, bt, rank)
        assert torch.equal(alone[0], y[t])
