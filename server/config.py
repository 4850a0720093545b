"""The engine's configuration: one frozen dataclass per role (model, cache, scheduler,
parallelism), and :class:`EngineConfig` holding them.

Only the CLI (``server/__main__.py``) reads argv and the environment; everything else receives
these objects. A field that is also a command-line flag declares it where it is defined
(:func:`server.options.option`: flag, help, choices, polarity). "auto" values (device,
attention backend, dtype, KV capacity) are resolved by :func:`server.resolve.resolve` into a
new config once the model's size and the machine are known, so every later reader sees
concrete numbers. The HTTP process's and the data-parallel front's configs are in
:mod:`server.front_config`; :class:`ModelConfig` is in :mod:`server.model_config` and
:class:`LoraConfig` in :mod:`server.lora_config` (both re-exported here).

Errors: invalid values raise :class:`ConfigError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from server.lora_config import LoraConfig
from server.model_config import (  # noqa: F401 - re-exported: one import for every option
    ATTENTION_BACKENDS,
    CPU_ISAS,
    DTYPE_NAMES,
    QUANTIZATION_MODES,
    ModelConfig,
)
from server.options import ConfigError, option

SCHEDULE_POLICIES = ("lpm", "dfs_weight", "fcfs", "random")
# speculative_ngram's auto value: longer drafts rarely survive verification (benchmarks.speculative)
DEFAULT_NGRAM_TOKENS = 8


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
        disable_jump_forward: decode forced strings of constrained requests token by token
            (the Engine sets it where long extends run on other kernels than single steps: AMX
            tiles or dense bf16 copies, the bf16/AMX class's default).
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
