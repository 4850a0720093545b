"""Engine configuration: validation errors and the resolution of auto values."""

import pytest

from server.config import ConfigError, EngineConfig, ModelConfig, resolve


def test_unknown_option_is_refused():
    with pytest.raises(ConfigError, match="bogus"):
        EngineConfig.from_kwargs(bogus=1)


@pytest.mark.parametrize("kwargs", [{"dtype": "int8"}, {"max_total_tokens": 3},
                                    {"mem_fraction": 1.5}, {"chunked_prefill_size": 0},
                                    {"schedule_policy": "nope"}, {"context_length": 1}])
def test_invalid_values(kwargs):
    with pytest.raises(ConfigError):
        EngineConfig.from_kwargs(**kwargs)


def test_resolve_auto_values():
    cfg = EngineConfig.from_kwargs(model="x", mem_fraction=0.5)
    r = resolve(cfg, kv_elements_per_token=100, model_context_length=2048,
                available_bytes=400_000, cpu_native_bf16=False)
    assert r.model.dtype == "float32" and r.model.context_length == 2048
    assert r.cache.max_total_tokens == 400_000 // 2 // 400
    assert cfg.model.dtype == "auto"  # the original is untouched


def test_auto_dtype_follows_native_bf16():
    cfg = EngineConfig()
    kw = dict(kv_elements_per_token=10, model_context_length=64, available_bytes=10**6)
    assert resolve(cfg, **kw, cpu_native_bf16=True).model.dtype == "bfloat16"
    assert resolve(cfg, **kw, cpu_native_bf16=False).model.dtype == "float32"
    pinned = EngineConfig.from_kwargs(dtype="float32")
    assert resolve(pinned, **kw, cpu_native_bf16=True).model.dtype == "float32"


def test_kv_cache_dtype_follows_dtype_or_halves_the_bytes_per_token():
    kw = dict(kv_elements_per_token=100, model_context_length=2048, available_bytes=400_000,
              cpu_native_bf16=False)
    auto = resolve(EngineConfig.from_kwargs(mem_fraction=0.5), **kw)
    assert auto.model.dtype == auto.model.kv_cache_dtype == "float32"
    bf16 = resolve(EngineConfig.from_kwargs(mem_fraction=0.5, kv_cache_dtype="bf16"), **kw)
    assert bf16.model.dtype == "float32" and bf16.model.kv_cache_dtype == "bfloat16"
    assert bf16.cache.max_total_tokens == 2 * auto.cache.max_total_tokens
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(kv_cache_dtype="int3")
    with pytest.raises(ConfigError, match="CUDA"):  # its attention backends read KV as q
        resolve(EngineConfig.from_kwargs(device="cuda", dtype="float16",
                                         kv_cache_dtype="bfloat16", max_total_tokens=64), **kw)


def test_deterministic_inference_is_refused_where_kernels_are_not_known_invariant():
    kw = dict(kv_elements_per_token=10, model_context_length=64)
    ok = resolve(EngineConfig.from_kwargs(deterministic_inference=True, max_total_tokens=64), **kw)
    assert ok.model.deterministic_inference
    for bad in ({"device": "cuda", "attention_backend": "reference"}, {"torch_compile": True},
                {"tp_size": 2, "quantization": "none"}):
        with pytest.raises(ConfigError, match="deterministic_inference"):
            resolve(EngineConfig.from_kwargs(deterministic_inference=True, max_total_tokens=64,
                                             **bad), **kw)


def test_cpu_bf16_probe(tmp_path):
    from kernels import cpu_has_native_bf16

    f = tmp_path / "cpuinfo"
    f.write_text("processor: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert not cpu_has_native_bf16(str(f))
    f.write_text("flags\t\t: fpu avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n")
    assert cpu_has_native_bf16(str(f))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))


def test_resolve_refuses_longer_context_than_model():
    cfg = EngineConfig(model=ModelConfig(context_length=4096))
    with pytest.raises(ConfigError, match="4096"):
        resolve(cfg, kv_elements_per_token=1, model_context_length=2048, available_bytes=10**9)


def test_resolve_refuses_a_tiny_pool():
    with pytest.raises(ConfigError, match="KV pool"):
        resolve(EngineConfig(), kv_elements_per_token=10**6, model_context_length=2048,
                available_bytes=10**6)


def test_quantization_is_cpu_only():
    kw = dict(kv_elements_per_token=10, model_context_length=64)
    cuda = EngineConfig.from_kwargs(device="cuda", attention_backend="reference",
                                    max_total_tokens=1024)
    assert resolve(cuda, **kw).model.quantization == "none"  # auto: dequantized on a GPU
    with pytest.raises(ConfigError, match="CPU only"):
        resolve(EngineConfig.from_kwargs(device="cuda", attention_backend="reference",
                                         max_total_tokens=1024, quantization="int4"), **kw)
    cpu = EngineConfig.from_kwargs(max_total_tokens=1024)
    assert resolve(cpu, **kw).model.quantization == "auto"


def test_the_cli_names_match_the_implementations():
    """server.config keeps its own copies (it must import without torch)."""
    import kernels
    from server import config
    from server.model import quantization

    assert config.ATTENTION_BACKENDS == kernels.ATTENTION_BACKENDS
    assert config.QUANTIZATION_MODES == quantization.QUANTIZATION_MODES


def test_the_http_side_imports_no_torch():
    """The HTTP process (server.launch and everything it imports) and ``python -m server
    --help`` load no torch, numpy or model code: only the scheduler process does."""
    import subprocess
    import sys

    code = ("import sys, server.launch, server.__main__\n"
            "print([m for m in ('torch', 'numpy', 'kernels', 'server.model.loader', "
            "'server.model.sampling', 'server.engine') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", out
