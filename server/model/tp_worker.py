"""The worker processes of tensor-parallel ranks 1..N-1: each joins the group, takes rank 0's
config, loads its shard and runs every pass rank 0 broadcasts (:mod:`server.model.tp_group`)
until rank 0 says stop or is gone.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

import torch

from server.cache.kv_pool import TokenKVPool
from server.config import ParallelConfig
from server.model.loader import load_model
from server.model.parallel import TPGroup, TPShard
from server.model.runner import ModelRunner
from server.model.tp_group import (
    device_of,
    init_process_group,
    recv_batch,
    share_config,
    threads_per_rank,
)

log = logging.getLogger("server.model.tp")


def run_worker(rank: int, pc: ParallelConfig, init_addr: str, device: str, threads: int,
               log_level: str = "info") -> None:
    """Process entry of rank > 0: join, take rank 0's config, load this rank's shard, then
    run every pass rank 0 broadcasts until it says stop or is gone."""
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    device = device_of(device, pc, rank)
    init_process_group(pc, rank, init_addr, device)
    config = share_config(None)
    mc = config.model
    loaded = load_model(mc.path)
    shard = TPShard.plan(loaded.arch, rank, pc.tp_size)
    pool = TokenKVPool(config.cache.max_total_tokens, loaded.arch.num_layers,
                       len(shard.kv_heads), loaded.arch.head_dim, dtype=mc.torch_kv_dtype,
                       device=device)
    runner = ModelRunner(loaded, pool, dtype=mc.torch_dtype, device=device,
                         max_positions=mc.context_length,
                         attention_backend=mc.attention_backend, cpu_isa=mc.cpu_isa,
                         tp=TPGroup(shard))
    log.info("rank %d ready: query heads %s, KV heads %s, intermediate %s", rank,
             shard.q_heads, shard.kv_heads, shard.inter)
    try:
        while (batch := recv_batch(device)) is not None:
            runner.forward(batch)
    except Exception as exc:  # noqa: BLE001 - rank 0 is gone: nothing left to serve
        log.error("rank %d: the tensor-parallel group broke (%s); exiting", rank, exc)
        os._exit(1)
    # Rank 0 said stop and is leaving the group too: gloo's teardown then races with the
    # peer's closing sockets and can abort the process ("terminate called without an active
    # exception", exit -6; seen once in CI). Nothing is left to release, so exit directly.
    logging.shutdown()
    os._exit(0)


def serve_node(pc: ParallelConfig, device: str, log_level: str = "info") -> int:
    """A node other than 0: run its ranks until they end; returns the exit code (0 when
    every rank stopped because rank 0 said so)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    procs = start_local_workers(pc, pc.dist_init_addr, device, log_level, daemon=False)
    for p in procs:
        p.join()
    return max((p.exitcode or 0 for p in procs), default=0)


def start_local_workers(pc: ParallelConfig, init_addr: str, device: str,
                        log_level: str = "info", daemon: bool = True) -> list[mp.Process]:
    """Spawn this node's ranks other than rank 0 (all of them on nodes > 0) on ``device``
    ("cpu" or "cuda"). The cores are divided among the node's ranks."""
    ranks = [r for r in pc.local_ranks if r != 0]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_worker,
                         args=(r, pc, init_addr, device, threads_per_rank(pc), log_level),
                         name=f"sgl-tp-rank{r}", daemon=daemon) for r in ranks]
    for p in procs:
        p.start()
    return procs
