"""torch.compile (inductor) over the decoder stack, with attention as an opaque custom op.

Why: on a CPU a decode step of a small model is dominated by per-op dispatch (norms, RoPE,
residual adds, casts: ~15 small ops a layer); inductor fuses them into a few C++ loops and runs
the whole stack from one call. Attention reads the KV pool through per-batch metadata held by
the attention backend (Python lists, index rows), so it is registered as the custom op
``sgl::attention``: the graph does not break, and the op's body is the backend's own
``store_kv`` + ``attend``.

The op finds its backend through a registry keyed by an integer id (:func:`register_backend`);
the id is a constant of the compiled graph, so one compiled graph serves every layer call and
every batch shape (token counts are dynamic: marked with ``torch._dynamo.mark_dynamic``).

Compiled artifacts are cached on disk (inductor's FX-graph cache under ``cache_dir``), so a
warm start only re-loads them.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Callable

import torch

from kernels.base import AttentionBackend

log = logging.getLogger("server.model")

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sgl-adapters", "inductor")

_backends: dict[int, AttentionBackend] = {}
_ids = itertools.count()


def register_backend(backend: AttentionBackend) -> int:
    """Make ``backend`` reachable from the ``sgl::attention`` op; returns its id."""
    key = next(_ids)
    _backends[key] = backend
    return key


def unregister_backend(key: int) -> None:
    """Forget backend ``key`` (idempotent); graphs compiled against it must not run again."""
    _backends.pop(key, None)


@torch.library.custom_op("sgl::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: int, layer: int,
                  scale: float, window: int, softcap: float) -> torch.Tensor:
    attn = _backends[backend]
    attn.store_kv(layer, k, v)
    return attn.attend(layer, q, scale, window, softcap)


@_attention_op.register_fake
def _(q, k, v, backend, layer, scale, window, softcap):
    return torch.empty_like(q)


def attention(attn: AttentionBackend, backend_id: int | None, layer: int, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0,
              softcap: float = 0.0) -> torch.Tensor:
    """Store the new K/V ([T, Hkv, D]) and attend with q [T, Hq, D]; returns [T, Hq, D].
    ``window``, ``softcap``: see :meth:`kernels.base.AttentionBackend.attend`.

    Eager calls go straight to the backend; under torch.compile (``backend_id`` set) through
    the opaque custom op."""
    if backend_id is not None and torch.compiler.is_compiling():
        return _attention_op(q, k, v, backend_id, layer, scale, window, softcap)
    attn.store_kv(layer, k, v)
    return attn.attend(layer, q, scale, window, softcap)


def compile_forward(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    cache_dir: str | None = DEFAULT_CACHE_DIR) -> Callable:
    """Wrap ``fn(input_ids [T] int64, positions [T] int64) -> hidden [T, H]`` with
    torch.compile (inductor, dynamic T). The first call of each shape class compiles (or loads
    from the cache); later calls replay."""
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
    compiled = torch.compile(fn, dynamic=True, fullgraph=True)

    def run(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        return compiled(input_ids, positions)

    return run
