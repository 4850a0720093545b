"""One selection point for attention backends (kernels.resolve_attention_backend), the server's
--attention-backend flag, and the Triton backend inside a real engine."""

import pytest
import torch

from kernels import create_attention_backend, resolve_attention_backend
from server.config import ConfigError, EngineConfig
from server.resolve import resolve

CPU = torch.device("cpu")


def test_auto_on_cpu_is_the_native_kernel_where_it_runs_and_unknown_names_fail():
    from kernels import cpu as native

    expected = "cpu" if native.available() else "reference"
    assert resolve_attention_backend("auto", CPU) == expected
    assert resolve_attention_backend("auto", CPU, cpu_isa="none") == "reference"
    assert resolve_attention_backend("auto", CPU, torch.float16, cpu_isa="avx2") == "reference"
    assert resolve_attention_backend("auto", CPU, torch.float32, 60, cpu_isa="avx2") == \
        "reference"  # head_dim not a multiple of 8
    assert resolve_attention_backend("reference", CPU) == "reference"
    with pytest.raises(ValueError, match="below avx2"):
        resolve_attention_backend("cpu", CPU, cpu_isa="none")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_attention_backend("xformers", CPU)


def test_unavailable_backends_say_why(monkeypatch):
    with pytest.raises(ValueError, match="flashinfer"):
        resolve_attention_backend("flashinfer", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="not on a CUDA device"):
        resolve_attention_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_attention_backend("triton", CPU) == "triton"
    buffers = [torch.zeros(4, 1, 8)]
    assert create_attention_backend("triton", buffers, buffers).name == "triton"


def test_auto_never_picks_flashinfer_where_its_kernels_cannot_run(monkeypatch):
    """On CUDA, "auto" skips FlashInfer for fp32 KV or an unsupported head size (it would fail
    at its first plan), and naming it then says why."""
    import importlib.util

    import kernels

    real = importlib.util.find_spec
    monkeypatch.setattr(kernels.importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("flashinfer", "triton")
                        else real(name, *a))
    cuda = torch.device("cuda")
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 64) == "flashinfer"
    assert resolve_attention_backend("auto", cuda, torch.float32, 64) == "triton"
    assert resolve_attention_backend("auto", cuda, torch.float16, 96) == "triton"
    with pytest.raises(ValueError, match="float16/bfloat16"):
        resolve_attention_backend("flashinfer", cuda, torch.float32, 64)
    with pytest.raises(ValueError, match="head_dim"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 80)
    # sliding windows / soft-capping (Gemma 2/3, Mistral) run on the Triton kernels
    assert resolve_attention_backend("auto", cuda, torch.bfloat16, 64, windowed=True) == "triton"
    with pytest.raises(ValueError, match="sliding windows"):
        resolve_attention_backend("flashinfer", cuda, torch.bfloat16, 64, windowed=True)


def test_engine_config_resolves_device_and_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = resolve(EngineConfig.from_kwargs(model="x", device="auto"), kv_elements_per_token=64,
                  model_context_length=128, available_bytes=1 << 30)
    assert cfg.model.device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        from kernels import cpu as native

        assert cfg.model.attention_backend == ("cpu" if native.available() else "reference")
        with pytest.raises(ConfigError, match="triton"):
            resolve(EngineConfig.from_kwargs(model="x", attention_backend="triton"),
                    kv_elements_per_token=64, model_context_length=128, available_bytes=1 << 30)
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig.from_kwargs(model="x", attention_backend="nope")
    with pytest.raises(ConfigError, match="device"):
        EngineConfig.from_kwargs(model="x", device="tpu")


@pytest.mark.parametrize("kind", ["tied", "gemma2"])
def test_triton_engine_generates_what_the_reference_engine_does(make_tiny_model, device, kind):
    """Greedy fp32 generation through the whole server engine (prefill with a shared cached
    prefix, batched decode) is token-identical with the Triton and the reference backends;
    "tied": 6 query heads over 2 KV heads, as SmolLM2; "gemma2": a 16-token window layer and
    soft-capped scores, with prompts longer than the window."""
    from server.engine import Engine

    path, _ = make_tiny_model(kind)
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33] * 3 + [40 + i] * (1 + 2 * i) for i in range(3)]
    prompts.append([7])
    sp = {"max_new_tokens": 6, "temperature": 0}
    outs = {}
    for backend in ("reference", "triton"):
        engine = Engine(path, max_total_tokens=2048, context_length=256, dtype="float32",
                        device=device, attention_backend=backend)
        assert engine.runner.attention.name == backend
        engine.generate(input_ids=prompts[0], sampling_params=sp)  # the shared prefix is cached
        outs[backend] = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                  sampling_params=sp)]
    assert outs["triton"] == outs["reference"]
    assert all(len(o) == 6 for o in outs["triton"])
