"""Tensor-parallel ranks in lockstep: the process group and the batch each step broadcasts from
rank 0 (the scheduler's rank) to the others. The worker processes of ranks 1..N-1 are
:mod:`server.model.tp_worker`'s; the model runner sends batches through this module and never
imports the workers (no import cycle).

Rank 0 owns the scheduler, the radix cache and the KV slot allocator; every rank owns a KV
pool of the same slot count holding its own KV heads. Before each forward pass rank 0
broadcasts the batch (token ids, positions, KV slots, and the request-table rows the batch
reads, compacted to [B, max_len]), so every rank runs the same pass on its shard; the layer
collectives (:mod:`server.model.parallel`) keep them in step. A rank that dies breaks the
next collective on every other rank (its connections close): rank 0 then stops the server
with :class:`TensorParallelError`, and the workers exit. While idle, rank 0 broadcasts a
heartbeat every HEARTBEAT_S seconds, so the workers' wait for the next batch never reaches the
group's timeout and a rank lost while idle is noticed.

Transport: ``torch.distributed`` (gloo on CPU, NCCL on CUDA) with a TCP rendezvous at
``dist_init_addr``; the batch goes through ``broadcast_object_list``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from server.config import EngineConfig, ParallelConfig
from server.model.forward_batch import ForwardBatch, ForwardMode
from server.model.parallel import TPGroup

HEARTBEAT_S = 10.0
_PING = "ping"


class TensorParallelError(SystemExit):
    """A tensor-parallel peer is gone: the scheduler process must stop (SystemExit passes the
    scheduler loop's per-batch isolation, which would otherwise keep serving)."""


def threads_per_rank(pc: ParallelConfig) -> int:
    """Compute threads of each of this node's ranks: its cores divided among them."""
    return max(1, len(os.sched_getaffinity(0)) // len(pc.local_ranks))


def free_init_addr() -> str:
    """A free "127.0.0.1:port" for a one-node rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def device_of(device: str, pc: ParallelConfig, rank: int) -> str:
    """The device of ``rank`` on this node: its own GPU on CUDA (a node's ranks use GPUs
    0, 1, ... in rank order), else ``device``."""
    if device.startswith("cuda"):
        return f"cuda:{rank - pc.local_ranks.start}"
    return device


def init_process_group(pc: ParallelConfig, rank: int, init_addr: str, device: str,
                       workers: Sequence[mp.Process] = ()) -> None:
    """Join the group (blocks until every rank has joined, or until one of this node's
    ``workers`` exits first). Raises TensorParallelError."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    failure: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank,
                                    world_size=pc.tp_size,
                                    timeout=datetime.timedelta(seconds=pc.timeout))
        except Exception as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    thread = threading.Thread(target=join, name="tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        dead = [p for p in workers if not p.is_alive()]
        if dead:
            raise TensorParallelError(f"tensor-parallel rank process {dead[0].name} exited "
                                      f"(code {dead[0].exitcode}) before the group formed")
    if failure:
        raise TensorParallelError(f"rank {rank}: could not join the tensor-parallel group at "
                                  f"{init_addr}: {failure[0]}") from failure[0]


def leave_process_group() -> None:
    """Destroy this process's group (so a later engine in the process can form a new one)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def share_config(config: EngineConfig | None) -> EngineConfig:
    """Rank 0 sends its resolved config (pool size, dtype, context) to every rank."""
    box = [config]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def send_batch(tp: TPGroup, batch: ForwardBatch | str | None) -> None:
    """Rank 0: the next pass for every other rank (None = stop, "ping" = a heartbeat).
    Raises TensorParallelError when a rank is gone."""
    payload: Any = batch if batch is None or isinstance(batch, str) else None
    if isinstance(batch, ForwardBatch):
        length = max(p + e for p, e in zip(batch.prefix_lens, batch.extend_lens))
        rows = torch.tensor(batch.req_rows, dtype=torch.int64,
                            device=batch.req_to_token.device)
        payload = (batch.mode.value, batch.input_ids.cpu(), batch.positions.cpu(),
                   batch.out_cache_loc.cpu(), batch.prefix_lens, batch.extend_lens,
                   batch.logits_indices.cpu(), batch.req_to_token[rows, :length].cpu())
    try:
        dist.broadcast_object_list([payload], src=0)
    except Exception as exc:  # noqa: BLE001
        raise TensorParallelError(f"tensor parallelism: a rank is gone ({exc}); stopping") \
            from exc
    tp.last_broadcast = time.monotonic()


def heartbeat(tp: TPGroup) -> None:
    """Rank 0, while idle: a heartbeat when none went out for HEARTBEAT_S seconds."""
    if time.monotonic() - tp.last_broadcast >= HEARTBEAT_S:
        send_batch(tp, _PING)


def recv_batch(device: str) -> ForwardBatch | None:
    """Ranks > 0: the pass rank 0 sent (its table rows renumbered 0..B-1), or None when it
    said stop; heartbeats are consumed here."""
    box: list[Any] = [_PING]
    while box[0] == _PING:
        box = [None]
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    mode, ids, pos, loc, prefix, extend, logits_idx, table = box[0]
    return ForwardBatch(ForwardMode(mode), [""] * len(prefix), ids, pos, loc,
                        list(range(len(prefix))), prefix, extend, logits_idx, table.to(device))
