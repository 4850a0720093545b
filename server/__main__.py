"""``python -m server`` (console script ``sgl-server``): the bundled inference server.

The only place that reads argv (and nothing reads the environment): flags become the frozen
configs of :mod:`server.config`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from server.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from server.front_config import CLI_CONFIGS, DataParallelConfig, HTTPConfig
from server.lora_config import LoraConfig
from server.options import build_from, declared_options


def build_parser() -> argparse.ArgumentParser:
    """The command line, generated from the configs' declared options
    (:func:`server.options.option`): a flag's name, help, choices, default and polarity are
    written once, on its field."""
    p = argparse.ArgumentParser(prog="python -m server", description=(
        "sgl-adapters inference server: RadixAttention KV cache, cache-aware continuous batching, "
        "OpenAI-compatible (/v1/...) and SGLang-style native (/generate) HTTP APIs."))
    for _, f, flag in declared_options(*CLI_CONFIGS):
        kwargs: dict = {"dest": f.name, "help": flag.help, "default": flag.default(f.default)}
        if flag.type is bool:
            kwargs["action"] = "store_false" if flag.invert else "store_true"
        else:
            kwargs["type"] = flag.type or (type(f.default) if f.default is not None else str)
            kwargs["choices"] = flag.choices
            kwargs["nargs"] = flag.nargs
            kwargs["metavar"] = None if flag.choices else flag.name[2:].upper().replace("-", "_")
        p.add_argument(flag.name, *flag.aliases, **kwargs)
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, HTTPConfig]:
    """The engine's and the HTTP process's configs from parsed flags. Raises ConfigError."""
    engine = dataclasses.replace(
        build_from(EngineConfig, args), model=build_from(ModelConfig, args),
        cache=build_from(CacheConfig, args), scheduler=build_from(SchedulerConfig, args),
        parallel=build_from(ParallelConfig, args), lora=build_from(LoraConfig, args))
    return engine, build_from(HTTPConfig, args)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv) and run what it asks for: the server, a
    data-parallel front over replicas, or a compute-only tensor-parallel node. Returns the
    exit code (2 for an invalid option)."""
    args = build_parser().parse_args(argv)
    try:
        engine, http = configs_from_args(args)
        dp = build_from(DataParallelConfig, args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=http.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if dp.dp_size > 1:
        from server.router.dp import serve_data_parallel

        return serve_data_parallel(list(sys.argv[1:] if argv is None else argv), dp.dp_size,
                                   http.host, http.port, dp.router_policy, http.log_level,
                                   parent_pid=http.parent_pid)
    if engine.parallel.node_rank > 0:  # a compute-only node of a multi-node group
        from server.model.tp_worker import serve_node

        return serve_node(engine.parallel, engine.model.device, http.log_level)
    from server.launch import serve  # heavy imports (torch, uvicorn) only when serving

    return asyncio.run(serve(engine, http))


if __name__ == "__main__":
    code = main()
    # The server has stopped (children reaped, sockets and temp dirs removed): skip the
    # interpreter's teardown (~0.4 s with the tokenizer stack loaded).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
