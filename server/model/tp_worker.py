"""The processes of a tensor-parallel group: rank 0's side (:class:`RankZero`: spawn this
node's other ranks, join, share the config, check them between steps, stop them) and the
workers of ranks 1..N-1 (:func:`run_worker`: join, take rank 0's config, load the shard, run
every pass rank 0 broadcasts through :mod:`server.model.tp_group` until it says stop or is
gone).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

import torch

from server.cache.kv_pool import TokenKVPool
from server.config import ConfigError, EngineConfig, ParallelConfig
from server.model.loader import load_model
from server.model.parallel import TPGroup, TPShard
from server.model.runner import ModelRunner
from server.model.tp_group import (
    TensorParallelError,
    device_of,
    free_init_addr,
    heartbeat,
    init_process_group,
    leave_process_group,
    recv_batch,
    send_batch,
    share_config,
    threads_per_rank,
)

log = logging.getLogger("server.model.tp")


class RankZero:
    """This process as rank 0 of a ``parallel.tp_size`` > 1 group (the engine's side): spawns
    this node's other ranks, joins the group, shares the resolved config and takes this
    process's share of the cores. ``group`` is the TPGroup the model runs with. Raises
    ConfigError (not node 0), UnsupportedModelError (heads that cannot be split),
    TensorParallelError (a rank that does not join)."""

    def __init__(self, config: EngineConfig, arch) -> None:
        pc, mc = config.parallel, config.model
        if pc.node_rank != 0:
            raise ConfigError("the engine runs on node 0; start other nodes with "
                              "`python -m server --node-rank N ...`")
        shards = [TPShard.plan(arch, r, pc.tp_size) for r in range(pc.tp_size)]
        addr = pc.dist_init_addr or free_init_addr()
        self.workers = start_local_workers(pc, addr, "cuda" if mc.device.startswith("cuda")
                                           else "cpu")
        init_process_group(pc, 0, addr, device_of(mc.device, pc, 0), self.workers)
        share_config(config)
        torch.set_num_threads(threads_per_rank(pc))
        self.group = TPGroup(shards[0])

    def check(self) -> None:
        """Raise TensorParallelError if a rank died: one of this node's processes, or any
        rank, through the idle heartbeat."""
        for p in self.workers:
            if not p.is_alive():
                raise TensorParallelError(f"tensor-parallel rank process {p.name} exited "
                                          f"(code {p.exitcode}); stopping")
        heartbeat(self.group)

    def close(self) -> None:
        """Tell the ranks to stop, join this node's, and leave the group."""
        if all(p.is_alive() for p in self.workers):
            send_batch(self.group, None)
            for p in self.workers:
                p.join(30)
        self.workers = []
        leave_process_group()


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
