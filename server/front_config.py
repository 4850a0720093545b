"""The configs of the processes in front of the engine: the HTTP process (:class:`HTTPConfig`)
and the data-parallel front (:class:`DataParallelConfig`), and :data:`CLI_CONFIGS`, every config
whose declared options make up ``python -m server``'s command line. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from server.lora_config import LoraConfig
from server.options import option

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

    host: str = option("127.0.0.1", "--host", "address to listen on (default 127.0.0.1)",
                       replica=False)
    port: int = option(30000, "--port", "port to listen on (default 30000)", replica=False)
    api_key: str | None = option(
        None, "--api-key", "require this key (Authorization: Bearer KEY) on every route except "
        "/health, /health_generate and /metrics")
    max_queued_requests: int = option(
        1024, "--max-queued-requests", "requests in flight beyond which new ones get 503 with "
        "Retry-After")
    max_body_bytes: int = 8 << 20
    shutdown_timeout: float = option(
        30.0, "--shutdown-timeout", "seconds in-flight requests may drain after SIGTERM")
    startup_timeout: float = 300.0
    log_level: str = option("info", "--log-level", "log verbosity",
                            choices=("debug", "info", "warning", "error"))
    parent_pid: int | None = option(
        None, "--parent-pid", "drain and exit once the process with this pid is gone (set by "
        "launchers such as sgl.Runtime, so the server dies with them)", type=int, replica=False)
    reasoning_parser: str = option(
        "auto", "--reasoning-parser", "return a reasoning model's <think>...</think> apart from "
        "the answer (reasoning_content) and apply constraints to the answer only; auto = when "
        "the chat template uses <think> and both markers are single tokens (Qwen3, "
        "DeepSeek-R1)", choices=REASONING_PARSERS)
    responses_store_size: int = option(
        1024, "--responses-store-size", "finished /v1/responses kept in memory for "
        "previous_response_id, within 256 MiB (least recently used evicted; 0 = none)")
    incremental_streaming_output: bool = option(
        False, "--incremental-streaming-output", "native /generate stream chunks carry only the "
        "new text, output_ids and output logprobs (SGLang's flag); default: every chunk is the "
        "whole response so far")
    stream_stall_timeout: float = option(
        30.0, "--stream-stall-timeout", "seconds a request's output may wait unread (its client "
        "stopped reading) before the request is aborted")

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


ROUTER_POLICIES = ("cache_aware", "round_robin", "least_load")  # see server.router.policy


@dataclass(frozen=True)
class DataParallelConfig:
    """Data parallelism on one machine (:mod:`server.router.dp`): ``dp_size`` server replicas,
    each on its share of the cores, behind the router on the public host and port.

    Attributes:
        dp_size: replicas (1 = none: this process serves).
        router_policy: how the router picks a replica (:mod:`server.router.policy`).
    """

    dp_size: int = option(
        1, "--dp-size", "data parallelism: this many server replicas (each on its share of the "
        "cores) behind the cache-aware router on --host/--port", replica=False)
    router_policy: str = option("cache_aware", "--router-policy",
                                "how the --dp-size router picks a replica",
                                choices=ROUTER_POLICIES, replica=False)

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ConfigError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ConfigError(f"router_policy must be one of {ROUTER_POLICIES}, got "
                              f"{self.router_policy!r}")


# Every class whose declared options make up ``python -m server``'s command line, in --help order.
CLI_CONFIGS = (HTTPConfig, ModelConfig, CacheConfig, SchedulerConfig, EngineConfig,
               ParallelConfig, LoraConfig, DataParallelConfig)
