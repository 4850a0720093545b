"""Runtime configuration: one frozen dataclass per role.

Only the CLI (``server/__main__.py``) reads argv and the environment; everything else receives
these objects. "auto" values (device, attention backend, dtype, KV capacity) are resolved by
:func:`resolve` into a new config once the model's size and the machine are known, so every
later reader sees concrete numbers.

Errors: invalid values raise :class:`ConfigError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

# No torch (or kernels, or the model stack) at import: the HTTP process and ``python -m server
# --help`` read this module. The names below are checked against kernels.ATTENTION_BACKENDS
# and server.model.quantization in tests/unit/test_config.py.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton", "flashinfer")
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
CPU_ISAS = ("auto", "none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")  # kernels.cpu_features
_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
SCHEDULE_POLICIES = ("lpm", "dfs_weight", "fcfs", "random")
# speculative_ngram's auto value: longer drafts rarely survive verification (benchmarks.speculative)
DEFAULT_NGRAM_TOKENS = 8


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    Attributes:
        path: HF directory (config.json + *.safetensors + tokenizer files), a ``.gguf`` file, a
            directory holding one ``.gguf``, or None for the embedded SmolLM2-135M-Instruct.
        dtype: "auto" (bfloat16 on CUDA and on CPUs with native bf16 arithmetic, else float32),
            "float32", "float16" or "bfloat16".
        kv_cache_dtype: dtype of the KV pool: "auto" (the compute ``dtype``), "float32",
            "float16" or "bfloat16". A narrower one than ``dtype`` (bfloat16 KV beside float32
            compute on a CPU without native bf16) halves the bytes attention reads per token and
            doubles the tokens a memory budget holds; K/V are rounded to it when stored
            (round-to-nearest-even) and attention still accumulates in float32. CPU only:
            :func:`resolve` refuses one that differs from ``dtype`` on CUDA.
        device: "auto" (cuda when torch sees a GPU, else cpu), "cpu" or "cuda[:N]".
        attention_backend: "auto" (FlashInfer, else Triton, on CUDA; the native "cpu" kernel
            on CPU where it is built and the CPU class allows, else the reference),
            "reference", "cpu", "triton" or "flashinfer"
            (:func:`kernels.resolve_attention_backend`).
        cpu_isa: the CPU class to plan for (:mod:`kernels.cpu_features`): "auto" (detected,
            or ``$SGL_CPU_ISA``), "none" (torch's own ops only), "avx2", "avx512",
            "avx512_vnni", "avx512_bf16" or "amx". A lower class than the machine's runs that
            class's code paths; a higher one only its decisions (bf16 compute, emulated where
            the CPU lacks it). Native kernels (``kernels.cpu``) run from "avx2" up, the VNNI
            linear kernels from "avx512_vnni" up where the CPU has VNNI (:attr:`linear_kernel`).
        context_length: max tokens per sequence (prompt + output); None = the model's own.
        served_model_name: name reported by the APIs; None = derived from the path.
        quantization: weight-only quantization kept in memory (:mod:`server.model.quantization`):
            "auto" (a GGUF file's own 4-bit types as int4, other quantized types as int8;
            float checkpoints unchanged), "none" (dequantize to ``dtype``), "int4" or "int8"
            (quantize every linear weight and the token embedding). CPU only: on CUDA
            :func:`resolve` makes "auto" "none" and refuses "int4"/"int8".
        deterministic_inference: every kernel a pass runs computes a row the same whatever
            else is in the pass, so batch shape, chunk boundaries, cache hits and verify passes
            never change a token or logprob. The default already is on CPUs without native
            bf16 with quantized weights (the native int4/int8 kernels and attention); on the
            bf16 classes (AVX512-BF16, AMX) this turns off the dense bf16 weight copies that
            speed up long extends. Dense weights (float checkpoints, quantization "none") still
            run torch's matmuls, which are not invariant (float32 ``F.linear`` rounds 1-5 rows
            differently from 64). Refused on CUDA, with torch_compile and with tp_size > 1,
            whose kernels are not known to be invariant.
        torch_compile: run the decoder stack through torch.compile on CPU
            (:mod:`server.model.compiled`; compiled graphs are cached on disk).
        disable_cuda_graph: on CUDA, run decode steps eagerly instead of replaying CUDA graphs
            captured per batch-size bucket (:mod:`server.model.cuda_graph`). No effect on CPU.
        cuda_graph_max_bs: largest decode batch served by a captured graph (tokens = requests);
            larger decode batches run eagerly.
    """

    path: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    context_length: int | None = None
    served_model_name: str | None = None
    attention_backend: str = "auto"
    quantization: str = "auto"
    cpu_isa: str = "auto"
    torch_compile: bool = False
    deterministic_inference: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_MODES}, got "
                              f"{self.quantization!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in _DTYPES:
            raise ConfigError(f"kv_cache_dtype must be 'auto' or one of {sorted(_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError(f"cpu_isa must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                              f"{self.attention_backend!r}")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"context_length must be >= 2, got {self.context_length}")

    @property
    def linear_kernel(self) -> str | None:
        """The ``kernels.cpu`` linear kernel this model's quantized linear layers run on
        (resolved configs: a CPU device, no torch_compile: a compiled decoder stack runs
        torch's own ops, which inductor fuses): "avx512_vnni" from that CPU class up, "avx2"
        from avx2 up, each where its library is built and the machine can run it
        (:func:`kernels.cpu.linear_kernel`); None for torch's packed ops."""
        from kernels import cpu as native

        if self.device != "cpu" or self.cpu_isa in ("auto", "none") or self.torch_compile:
            return None
        return native.linear_kernel(self.cpu_isa)

    @property
    def torch_dtype(self) -> "torch.dtype":  # noqa: F821 - torch is imported lazily
        """The compute dtype; only valid after :func:`resolve` (dtype != "auto")."""
        if self.dtype == "auto":
            raise ConfigError("dtype 'auto' must be resolved first (server.config.resolve)")
        import torch

        return getattr(torch, _DTYPES[self.dtype])

    @property
    def torch_kv_dtype(self) -> "torch.dtype":  # noqa: F821 - torch is imported lazily
        """The KV pool's dtype; only valid after :func:`resolve` (kv_cache_dtype != "auto")."""
        if self.kv_cache_dtype == "auto":
            raise ConfigError("kv_cache_dtype 'auto' must be resolved first "
                              "(server.config.resolve)")
        import torch

        return getattr(torch, _DTYPES[self.kv_cache_dtype])


@dataclass(frozen=True)
class CacheConfig:
    """KV memory.

    Attributes:
        max_total_tokens: KV pool capacity in tokens (shared by running requests and, from [2/9],
            the radix cache); None = derived from ``mem_fraction`` of available memory.
        mem_fraction: fraction of available host (CPU) or free device (GPU, measured before the
            weights load) memory for the pool; None = 0.05 on CPU (~1.1 GiB on a 24 GiB machine: the
            peak RSS budget of 2.5 GB), 0.6 on CUDA.
        disable_radix_cache: no prefix reuse (the same code path with a tree that never stores).
        hicache_size: GB of host memory for KV pages evicted from the pool
            (:mod:`server.cache.tiers`); None = 0 on CPU (the pool is host memory already), 4
            on CUDA.
        cache_dir: a directory where cached prefixes persist (on eviction and at shutdown)
            and are found again by a later server on the same model; None = off.
        cache_dir_size: GB the directory may hold for one model.
    """

    max_total_tokens: int | None = None
    mem_fraction: float | None = None
    disable_radix_cache: bool = False
    hicache_size: float | None = None
    cache_dir: str | None = None
    cache_dir_size: float = 10.0

    def host_tier_bytes(self, cuda: bool) -> int:
        """Bytes of the host tier (0 = off)."""
        size = self.hicache_size if self.hicache_size is not None else (4.0 if cuda else 0.0)
        return int(size * 2 ** 30)

    def __post_init__(self) -> None:
        if self.hicache_size is not None and self.hicache_size < 0:
            raise ConfigError(f"hicache_size must be >= 0 GB, got {self.hicache_size}")
        if self.cache_dir_size <= 0:
            raise ConfigError(f"cache_dir_size must be > 0 GB, got {self.cache_dir_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ConfigError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.mem_fraction is not None and not 0.0 < self.mem_fraction < 1.0:
            raise ConfigError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_running_requests: most requests decoding at once (rows of the request table).
        chunked_prefill_size: token budget of one extend batch; longer prompts are prefilled in
            chunks of at most this many tokens.
        schedule_policy: order of the waiting queue: "lpm" (longest prefix match),
            "dfs_weight", "fcfs" or "random" (see server.scheduler.policy).
        max_new_tokens_reserve: when admitting, each running request is assumed to still need
            min(remaining max_new_tokens, this) KV slots; a wrong guess is corrected by retraction.
        starvation_limit_steps: a waiting request passed over by later arrivals in this many
            scheduling steps is admitted before anything else.
        max_cache_aware_queue: above this many waiting requests, lpm/dfs_weight fall back to
            fcfs (matching every request against the tree each step costs time).
        disable_jump_forward: decode forced strings of constrained requests token by token.
        mixed_chunk: extend batches also carry one decode token of every running request
            (decoding never waits behind arriving prompts); False = prefill-first, decode only
            when no prompt is waiting.
        speculative_ngram: draft up to this many tokens per step from the sequence's own
            earlier n-grams (prompt lookup, :mod:`server.scheduler.ngram`), verified like
            jump-forward drafts and kept only where the verify pass pays
            (:mod:`server.scheduler.draft_cost`); 0 = off; None = auto: DEFAULT_NGRAM_TOKENS
            where the runner is batch-invariant (drafts then never change an output, see
            ``ModelRunner.batch_invariant``), else off (the Engine resolves it).
    """

    max_running_requests: int = 128
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    max_new_tokens_reserve: int = 256
    starvation_limit_steps: int = 64
    max_cache_aware_queue: int = 128
    disable_jump_forward: bool = False
    mixed_chunk: bool = True
    speculative_ngram: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_ngram is not None and not 0 <= self.speculative_ngram <= 64:
            raise ConfigError(f"speculative_ngram must be in [0, 64], got {self.speculative_ngram}")
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            raise ConfigError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ConfigError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.max_new_tokens_reserve < 1:
            raise ConfigError("max_new_tokens_reserve must be >= 1")
        if self.starvation_limit_steps < 1:
            raise ConfigError("starvation_limit_steps must be >= 1")
        if self.max_cache_aware_queue < 1:
            raise ConfigError("max_cache_aware_queue must be >= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (:mod:`server.model.parallel`).

    Attributes:
        tp_size: ranks that split every layer (one process each; rank 0 runs the scheduler).
        nnodes, node_rank: machines taking part and this one's index; each runs
            ``tp_size / nnodes`` ranks (node 0 serves HTTP, the others only compute).
        dist_init_addr: "host:port" of the torch.distributed TCP rendezvous (rank 0 listens
            there); None = a free port on 127.0.0.1 (one node).
        timeout: seconds a collective may wait for a peer before the server gives up.
    """

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ConfigError(f"nnodes ({self.nnodes}) must divide tp_size ({self.tp_size})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("dist_init_addr (host:port of node 0) is needed with nnodes > 1")
        if self.dist_init_addr is not None and not re.fullmatch(r"[^:\s]+:\d+",
                                                                 self.dist_init_addr):
            raise ConfigError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        per = self.tp_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`server.engine.Engine` (and later the scheduler process) needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat keyword arguments (``model=``, ``dtype=``, ``max_total_tokens=`` ...).

        ``model`` maps to ``ModelConfig.path``. Raises ConfigError for an unknown keyword.
        """
        kwargs = dict(kwargs)
        if "model" in kwargs:
            kwargs["path"] = kwargs.pop("model")
        parts = {}
        for name, klass in (("model", ModelConfig), ("cache", CacheConfig),
                            ("scheduler", SchedulerConfig), ("parallel", ParallelConfig)):
            names = {f.name for f in dataclasses.fields(klass)}
            parts[name] = klass(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        seed = kwargs.pop("seed", 0)
        if kwargs:
            raise ConfigError(f"unknown engine option(s): {sorted(kwargs)}")
        return cls(seed=seed, **parts)


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
    model = dataclasses.replace(model, dtype=_DTYPES[model.dtype], kv_cache_dtype=_DTYPES[
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


REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek-r1")  # see server.reasoning


@dataclass(frozen=True)
class HTTPConfig:
    """The HTTP process. Times in seconds, sizes in bytes.

    Attributes:
        host, port: where to listen (default 127.0.0.1:30000).
        api_key: required on every route but health/metrics when set.
        max_queued_requests: requests in flight beyond which new ones get 503 + Retry-After.
        max_body_bytes: larger request bodies get 413 before they are parsed.
        shutdown_timeout: on SIGTERM, how long in-flight requests may drain.
        startup_timeout: how long to wait for the scheduler process to load the model.
        log_level: "debug", "info", "warning" or "error".
        parent_pid: when set, the server drains and exits once this process is gone (how a
            launcher, e.g. ``sgl.Runtime`` or a test, makes its server die with it).
        reasoning_parser: "auto" (from the chat template, when unambiguous), "none", "qwen3"
            or "deepseek-r1" (:mod:`server.reasoning`).
        responses_store_size: finished ``/v1/responses`` kept in memory for
            ``previous_response_id``, within 256 MiB (least recently used evicted; 0 stores
            none).
        incremental_streaming_output: native ``/generate`` stream chunks carry only what is
            new (SGLang's flag of the same name); default: each chunk is cumulative.
        stream_stall_timeout: a request whose outputs wait this long unread (its client
            stopped reading) is aborted, its KV freed, and the client gets an error event.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_body_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0
    startup_timeout: float = 300.0
    log_level: str = "info"
    parent_pid: int | None = None
    reasoning_parser: str = "auto"
    responses_store_size: int = 1024
    incremental_streaming_output: bool = False
    stream_stall_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.responses_store_size < 0:
            raise ConfigError("responses_store_size must be >= 0")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.stream_stall_timeout <= 0:
            raise ConfigError("stream_stall_timeout must be > 0")
        if self.max_queued_requests < 1:
            raise ConfigError("max_queued_requests must be >= 1")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be debug/info/warning/error, got {self.log_level!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                              f"{self.reasoning_parser!r}")
