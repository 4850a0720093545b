"""Turning a config's "auto" values (device, attention backend, dtype, KV capacity) into
concrete ones once the model's size and the machine are known (:func:`resolve`), so every later
reader sees concrete numbers. Imports torch: the scheduler side only.
"""

from __future__ import annotations

import dataclasses
import os

from server.config import DTYPE_NAMES, ConfigError, EngineConfig


def available_memory_bytes(device: str) -> int:
    """Free memory usable for the KV pool: free device memory on CUDA, available RAM on CPU."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve(config: EngineConfig, *, kv_elements_per_token: int, model_context_length: int,
            available_bytes: int | None = None, cpu_native_bf16: bool | None = None,
            head_dim: int | None = None, windowed: bool = False) -> EngineConfig:
    """Return a copy of ``config`` with every "auto"/None value made concrete.

    Args:
        kv_elements_per_token: K+V elements one token takes over all layers
            (2 * layers * kv_heads * head_dim); multiplied by the resolved KV dtype's size.
        model_context_length: the model's own maximum sequence length in tokens.
        available_bytes: memory to size the pool from; None = measured on ``config.model.device``.
        head_dim: the model's attention head size (backends support only some; None = any).
        windowed: the model has sliding-window layers or attention-logit soft-capping.
        cpu_native_bf16: the CPU has bf16 instructions; then "auto" picks bfloat16 on CPU
            too (measured 1.8-6x faster matmuls than float32). None = from the resolved
            ``cpu_isa`` (:func:`kernels.cpu_features.native_bf16`).

    Raises:
        ConfigError: the pool would hold fewer than 16 tokens, or context_length exceeds the model's.
    """
    # each step reads what the steps before it resolved (device -> quantization -> ISA -> dtype
    # -> backend -> context -> pool): one ordered sequence
    import torch

    from kernels import resolve_attention_backend

    model, cache = config.model, config.cache
    if model.device == "auto":
        model = dataclasses.replace(model, device="cuda" if torch.cuda.is_available() else "cpu")
    if model.device.startswith("cuda"):
        # The packed weight-only matmuls used here are torch's CPU kernels.
        if model.quantization in ("int4", "int8"):
            raise ConfigError(f"quantization {model.quantization!r} runs on CPU only (torch's "
                              "packed CPU matmuls); use 'none' or 'auto' on CUDA")
        model = dataclasses.replace(model, quantization="none")
    if config.parallel.tp_size > 1 and config.lora.enabled:
        raise ConfigError("LoRA adapters with tp_size > 1 are not supported")
    if config.parallel.tp_size > 1:  # ranks shard dense weights (packed int4 rows/columns
        if model.quantization in ("int4", "int8"):  # are not split across ranks)
            raise ConfigError("quantization with tp_size > 1 is not supported; use 'none'")
        if model.torch_compile:
            raise ConfigError("torch_compile with tp_size > 1 is not supported")
        model = dataclasses.replace(model, quantization="none", disable_cuda_graph=True)
    from kernels.cpu_features import cpu_isa, native_bf16

    if model.cpu_isa == "auto":
        try:
            model = dataclasses.replace(model, cpu_isa=cpu_isa())
        except ValueError as exc:  # a bad $SGL_CPU_ISA
            raise ConfigError(str(exc)) from exc
    if cpu_native_bf16 is None:
        cpu_native_bf16 = native_bf16(model.cpu_isa)
    if model.dtype == "auto":
        bf16 = model.device.startswith("cuda") or cpu_native_bf16
        model = dataclasses.replace(model, dtype="bfloat16" if bf16 else "float32")
    model = dataclasses.replace(model, dtype=DTYPE_NAMES[model.dtype], kv_cache_dtype=DTYPE_NAMES[
        model.dtype if model.kv_cache_dtype == "auto" else model.kv_cache_dtype])
    if model.kv_cache_dtype != model.dtype and model.device.startswith("cuda"):
        raise ConfigError(f"kv_cache_dtype {model.kv_cache_dtype!r} differs from dtype "
                          f"{model.dtype!r}: the CUDA attention backends read the KV pool in the "
                          "compute dtype; leave kv_cache_dtype 'auto' on CUDA")
    if model.deterministic_inference and (model.device.startswith("cuda") or model.torch_compile
                                          or config.parallel.tp_size > 1):
        raise ConfigError("deterministic_inference runs on one CPU process without torch_compile "
                          "(the CUDA, inductor and tensor-parallel kernels are not known to be "
                          "batch-invariant)")
    if model.torch_compile and model.device == "cpu" and model.attention_backend == "cpu":
        raise ConfigError("torch_compile runs the reference attention on CPU (inductor fuses "
                          "its ops); leave attention_backend 'auto' or 'reference'")
    try:
        requested = ("reference" if model.torch_compile and model.device == "cpu"
                     and model.attention_backend == "auto" else model.attention_backend)
        backend = resolve_attention_backend(requested, torch.device(model.device),
                                            model.torch_kv_dtype, head_dim, windowed,
                                            cpu_isa=model.cpu_isa)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    model = dataclasses.replace(model, attention_backend=backend)
    ctx = model.context_length or model_context_length
    if ctx > model_context_length:
        raise ConfigError(
            f"context_length {ctx} exceeds the model's maximum {model_context_length}")
    model = dataclasses.replace(model, context_length=ctx)
    kv_bytes_per_token = kv_elements_per_token * model.torch_kv_dtype.itemsize
    if cache.max_total_tokens is None:
        avail = available_memory_bytes(model.device) if available_bytes is None else available_bytes
        fraction = cache.mem_fraction or (0.6 if model.device.startswith("cuda") else 0.05)
        tokens = int(avail * fraction) // max(kv_bytes_per_token, 1)
        # On CPU, more than ~256k tokens of KV only slows allocation; the cap is generous.
        tokens = min(tokens, 1 << 18)
        if tokens < 16:
            raise ConfigError(
                f"only {avail} bytes available: the KV pool would hold {tokens} tokens; "
                "set max_total_tokens or mem_fraction")
        cache = dataclasses.replace(cache, max_total_tokens=tokens)
    return dataclasses.replace(config, model=model, cache=cache)
