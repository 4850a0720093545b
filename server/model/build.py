"""Building the model runner a resolved :class:`server.config.EngineConfig` asks for: the
decoder's :class:`server.model.runner.ModelRunner` or an encoder's
:class:`server.model.encoder_runner.EncoderRunner`, and the config changes an encoder needs
(:func:`encoder_engine_config`), and the draft options its runner allows (:func:`draft_options`).
Called by :class:`server.engine.Engine`.
"""

from __future__ import annotations

import dataclasses

from kernels.cpu_features import at_least, native_bf16
from server.cache.kv_pool import TokenKVPool
from server.config import DEFAULT_NGRAM_TOKENS, ConfigError, EngineConfig, SchedulerConfig
from server.model.encoder_runner import EncoderRunner
from server.model.loader import LoadedModel
from server.model.parallel import TPGroup
from server.model.runner import ModelRunner

# Extend passes of at least this many tokens run quantized linears on a dense bf16 copy where
# the CPU has bf16 dot products and the linear kernel is the AVX2 one (measured break-even ~32
# rows; see QuantLinear), or the CPU has AMX tiles. The AVX-512 VNNI kernel was faster than
# oneDNN's dense bf16 matmul at every row count on an AVX512-BF16 CPU (docs/benchmarks.md, "Native CPU
# linear layers"); AMX's bf16 tiles were not measured against it.
DENSE_PREFILL_ROWS = 64


def dense_prefill_rows(mc, linear: str | None) -> int | None:
    """Extend passes of at least this many tokens run on dense bf16 weight copies (None:
    never): see DENSE_PREFILL_ROWS; never with deterministic_inference. ``mc``: the resolved
    :class:`server.config.ModelConfig`."""
    if (mc.device != "cpu" or not native_bf16(mc.cpu_isa) or mc.deterministic_inference
            or (linear == "avx512_vnni" and not at_least("amx", mc.cpu_isa))):
        return None
    return DENSE_PREFILL_ROWS


def encoder_engine_config(config: EngineConfig) -> EngineConfig:
    """``config`` (resolved) for an encoder model: no radix cache (a bidirectional token's KV
    depends on what follows it) and extend batches that hold the longest prompt (prompts run
    whole). Raises ConfigError for what an encoder cannot do: tensor parallelism, LoRA."""
    if config.parallel.tp_size > 1:
        raise ConfigError("encoder models (BERT family) are not supported with tp_size > 1")
    if config.lora.enabled:
        raise ConfigError("LoRA adapters on encoder models (BERT family) are not supported")
    sc = config.scheduler
    return dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, disable_radix_cache=True),
        scheduler=dataclasses.replace(sc, chunked_prefill_size=max(
            sc.chunked_prefill_size, config.model.context_length)))


def build_runner(loaded: LoadedModel, config: EngineConfig, kv_pool: TokenKVPool, *,
                 req_to_token, tp: TPGroup | None, lora_slots: int = 0,
                 max_lora_rank: int = 0) -> ModelRunner | EncoderRunner:
    """The runner of ``loaded`` as the resolved ``config`` asks: ``kv_pool`` its KV buffers,
    ``req_to_token`` the request table [R, context] int64, ``tp`` this rank's group (None
    without tensor parallelism), ``lora_slots`` / ``max_lora_rank`` its LoRA slots. Raises
    what the runners raise (WeightLoadError, QuantizationError, ValueError)."""
    mc, sc = config.model, config.scheduler
    if loaded.arch.encoder is not None:
        return EncoderRunner(loaded, dtype=mc.torch_dtype, device=mc.device)
    linear = mc.linear_kernel
    return ModelRunner(loaded, kv_pool, dtype=mc.torch_dtype, device=mc.device,
                       max_positions=mc.context_length, attention_backend=mc.attention_backend,
                       quantization=mc.quantization, compile=mc.torch_compile,
                       dense_prefill_rows=dense_prefill_rows(mc, linear),
                       native_linear=linear, cpu_isa=mc.cpu_isa, cpu_threads=mc.cpu_threads,
                       cuda_graph_max_bs=(0 if mc.disable_cuda_graph else
                                          min(mc.cuda_graph_max_bs, sc.max_running_requests)),
                       req_to_token=req_to_token, tp=tp, lora_slots=lora_slots,
                       max_lora_rank=max_lora_rank)


def draft_options(sc: SchedulerConfig, runner: ModelRunner | EncoderRunner) -> SchedulerConfig:
    """``sc`` with its drafts resolved for ``runner`` so that they never change an output
    (RELIABILITY rule 8): jump-forward off where extends of 64+ tokens run on AMX tiles or
    dense bf16 copies, not the single steps' int4 kernel (a verify pass can be that long;
    --enable-deterministic-inference keeps every pass on the int4 kernel), and n-gram drafts
    (``speculative_ngram`` None = auto) on only where the runner is batch-invariant."""
    qr = runner.quant_report
    long_elsewhere = bool(qr.amx_modules or qr.prefill_copy_bytes)
    ngram = sc.speculative_ngram
    if ngram is None:
        ngram = DEFAULT_NGRAM_TOKENS if runner.batch_invariant else 0
    return dataclasses.replace(sc, disable_jump_forward=sc.disable_jump_forward or long_elsewhere,
                               speculative_ngram=ngram)
