"""Engine configuration: validation errors and the resolution of auto values."""

import pytest

from server.config import ConfigError, EngineConfig, ModelConfig
from server.resolve import resolve


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


def test_every_flag_is_declared_once_on_its_field():
    """``python -m server``'s flags are exactly the configs' declared options (one field
    each), and with no flags the CLI builds the configs' own defaults (the one declared
    difference: the server's device is "auto", the offline Engine's "cpu")."""
    import dataclasses

    from server.__main__ import build_parser, configs_from_args
    from server.front_config import CLI_CONFIGS, DataParallelConfig, HTTPConfig
    from server.options import build_from, declared_options

    declared = list(declared_options(*CLI_CONFIGS))
    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {n for _, _, flag in declared for n in (flag.name, *flag.aliases)}
    dests = [f.name for _, f, _ in declared]
    assert len(dests) == len(set(dests)), "two declared options share a field name"
    engine, http = configs_from_args(parser.parse_args([]))
    assert engine == EngineConfig(model=ModelConfig(device="auto")) and http == HTTPConfig()
    assert build_from(DataParallelConfig, parser.parse_args([])) == DataParallelConfig()
    engine, _ = configs_from_args(parser.parse_args(["--disable-mixed-chunk", "--seed", "7",
                                                     "--mem-fraction-static", "0.2"]))
    assert engine.scheduler.mixed_chunk is False and engine.seed == 7
    assert engine.cache.mem_fraction == 0.2
    # the Engine takes every field of its four configs and the seed, and nothing else
    fields = [f for cls in (ModelConfig, config_cls("cache"), config_cls("scheduler"),
                            config_cls("parallel"), config_cls("lora")) for f in dataclasses.fields(cls)]
    kwargs = {("model" if f.name == "path" else f.name): f.default for f in fields}
    assert EngineConfig.from_kwargs(seed=1, **kwargs).seed == 1
    for name in ("port", "dp_size", "api_key"):  # the HTTP process's and the front's
        with pytest.raises(ConfigError, match=name):
            EngineConfig.from_kwargs(**{name: None})


def config_cls(part: str) -> type:
    import dataclasses

    return next(f.default_factory for f in dataclasses.fields(EngineConfig) if f.name == part)


def test_replicas_inherit_every_flag_but_the_fronts_own():
    from server.router.dp import replica_argv

    argv = ["--dp-size", "2", "--router-policy=round_robin", "--host", "0.0.0.0", "--port",
            "8000", "--parent-pid", "1", "--model", "m.gguf", "--disable-mixed-chunk",
            "--mem-fraction-static=0.1", "--tp-size", "1"]
    assert replica_argv(argv) == ["--model", "m.gguf", "--disable-mixed-chunk",
                                  "--mem-fraction-static=0.1", "--tp-size", "1"]
