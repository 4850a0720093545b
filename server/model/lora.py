"""Multi-LoRA in one forward pass: the runner's adapter slots (:class:`LoraWeights`), the
per-pass row-to-adapter map (:class:`LoraBatch`), and the engine's name -> slot registry
(:class:`LoraRegistry`).

Layout (:class:`LoraProjection`): for each layer and projection (:data:`PROJECTIONS`), every
slot owns ``parts * R`` rows of A (one block of R = max_rank per HF projection fused in ours:
q, k and v; gate and up) and R columns of each part's B; scales are folded into B, and an empty slot or block
is zeros.

One pass over rows of several adapters (and of none: the base model) adds, per projection,
``((x A^T) * M)_k B_k^T`` for each part k, where the mask M keeps each row's own slot's
columns: two dense matmuls per part and a product whatever the mix, so the op count does not
grow with the number of adapters (the segmented gather matmul of Punica / S-LoRA, Chen et al.
2023 and Sheng et al. 2023, as masked dense matmuls over the slots the pass uses). Rows of no
adapter get exact zeros added. A pass with no adapter rows skips all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F

from server.lora_config import LoraConfig
from server.model.lora_files import (
    PROJECTIONS,
    LoraAdapter,
    LoraError,
    adapter_rank,
    read_adapter,
)

DEFAULT_MAX_RANK = 16


class LoraBusyError(LoraError):
    """An adapter cannot be unloaded: requests using it are queued or running (HTTP 409)."""


def slot_shape(config: LoraConfig) -> tuple[int, int]:
    """(slots, max rank) the runner keeps for ``config``: (0, 0) with LoRA off; the rank
    defaults to the largest of the start-up adapters' (DEFAULT_MAX_RANK with none). Raises
    LoraError (an adapter_config.json that cannot be read)."""
    if not config.enabled:
        return 0, 0
    rank = config.max_lora_rank or max(
        (adapter_rank(path) for _, path in config.adapters()), default=DEFAULT_MAX_RANK)
    return config.max_loras_per_batch, rank


@dataclass
class LoraProjection:
    """One projection's slots. ``a``: [slots * parts * R, in], rows (slot, part, rank) in that
    order; ``b``: per part k, [rows_k, slots * R], columns (slot, rank); ``rows``: (first row,
    rows) of each part in the projection's output (q, k, v; gate, up; or the whole)."""

    a: torch.Tensor
    b: list[torch.Tensor]
    rows: list[tuple[int, int]]


class LoraWeights:
    """The stacked A and B factors of ``slots`` adapter slots for ``model`` (a loaded
    :class:`server.model.llama.LlamaForCausalLM`), in ``dtype`` on ``device``. Memory:
    slots * max_rank * (parts * in + out) elements per projection.

    Args: max_rank: the largest r a slot takes (R)."""

    def __init__(self, model, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.slots, self.max_rank, self.dtype = slots, max_rank, dtype
        self.stacks: list[dict[str, LoraProjection]] = []
        self.used: set[int] = set()
        # bf16 on CPU: the factors of slots [0, packed_slots) also reordered for oneDNN
        # (1.4-1.8x the bandwidth of the plain matmul at decode's 16 rows: docs/benchmarks.md)
        self.packed: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.packed_slots = 0
        # LoraBatch.native_args's tensor lists, by (lo, hi, packed); emptied by _repack
        self.flat: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
        self._pack = (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
                      and torch.backends.mkldnn.is_available())
        for layer in model.layers:
            per: dict[str, LoraProjection] = {}
            for proj in PROJECTIONS:
                linear = getattr(layer, proj, None)
                if linear is None:  # a mixture-of-experts layer's MLP
                    continue
                sizes = (list(layer.split) if proj == "qkv_proj" else
                         [linear.out_features // 2] * 2 if proj == "gate_up_proj"
                         else [linear.out_features])
                offsets = [sum(sizes[:k]) for k in range(len(sizes))]
                per[proj] = LoraProjection(
                    torch.zeros(slots * len(sizes) * max_rank, linear.in_features,
                                dtype=dtype, device=device),
                    [torch.zeros(n, slots * max_rank, dtype=dtype, device=device)
                     for n in sizes], list(zip(offsets, sizes)))
            self.stacks.append(per)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter``'s factors into ``slot`` (cleared first). Raises LoraError when
        its rank exceeds ``max_rank`` or it targets a projection a layer lacks."""
        if adapter.rank > self.max_rank:
            raise LoraError(f"adapter {adapter.name!r} has rank {adapter.rank}, above "
                            f"--max-lora-rank {self.max_rank}")
        for part in adapter.parts:
            if part.proj not in self.stacks[part.layer]:
                raise LoraError(f"adapter {adapter.name!r}: layer {part.layer} has no "
                                f"{part.proj} (an MoE layer)")
        self.clear(slot)
        R = self.max_rank
        for part in adapter.parts:
            p = self.stacks[part.layer][part.proj]
            r, n_parts = part.a.shape[0], len(p.rows)
            # the projection's parts this HF module covers: one (q_proj), or all of a fused
            # one (Phi-3's qkv_proj: its A repeated for each, its B split by rows)
            for k, (first, rows) in enumerate(p.rows):
                if first < part.offset or first + rows > part.offset + part.rows:
                    continue
                at = (slot * n_parts + k) * R
                p.a[at:at + r] = part.a.to(self.dtype)
                p.b[k][:, slot * R:slot * R + r] = \
                    part.b[first - part.offset:first - part.offset + rows].to(self.dtype)
        self.used.add(slot)
        self._repack()

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s factors (an unloaded adapter)."""
        R = self.max_rank
        for per in self.stacks:
            for p in per.values():
                n_parts = len(p.rows)
                p.a[slot * n_parts * R:(slot + 1) * n_parts * R] = 0
                for b in p.b:
                    b[:, slot * R:(slot + 1) * R] = 0
        self.used.discard(slot)
        self._repack()

    def _repack(self) -> None:
        """Reorder the factors of slots [0, highest used + 1) for oneDNN (bf16 CPU only)."""
        self.packed, self.packed_slots, self.flat = {}, 0, {}
        n = max(self.used, default=-1) + 1
        if not self._pack or n == 0:
            return
        R, reorder = self.max_rank, torch.ops.mkldnn._reorder_linear_weight
        try:
            for layer, per in enumerate(self.stacks):
                for proj, p in per.items():
                    self.packed[layer, proj] = (
                        reorder(p.a[:n * len(p.rows) * R].contiguous()),
                        [reorder(b[:, :n * R].contiguous()) for b in p.b])
        except RuntimeError:  # this oneDNN build cannot: the plain matmuls run
            self._pack, self.packed = False, {}
            return
        self.packed_slots = n

    def batch(self, token_slots: torch.Tensor) -> "LoraBatch | None":
        """The pass's :class:`LoraBatch` for ``token_slots`` ([T] int64, each row's slot, -1
        for the base model), or None when no row has an adapter."""
        return LoraBatch.of(self, token_slots)


@dataclass
class LoraBatch:
    """Which slot each row of one pass uses. ``slots``: [T] int64 (-1: none); slots
    [lo, hi) take part."""

    weights: LoraWeights
    slots: torch.Tensor
    lo: int
    hi: int
    packed: bool = False  # slots [0, weights.packed_slots) on the reordered factors
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, weights: LoraWeights, slots: torch.Tensor) -> "LoraBatch | None":
        """None when no row of ``slots`` has an adapter. Where the slots used span at least
        half of the packed ones, the pass runs over all of those (the reordered matmul reads
        the other slots' zeros-masked factors too, and still wins)."""
        used = slots[slots >= 0]
        if used.numel() == 0:
            return None
        lo, hi, n = int(used.min()), int(used.max()) + 1, weights.packed_slots
        if n and hi <= n and 2 * (hi - lo) >= n:
            return cls(weights, slots, 0, n, packed=True)
        return cls(weights, slots, lo, hi)

    def take(self, rows: torch.Tensor) -> "LoraBatch":
        """The batch of rows ``rows`` ([N] int64) only (the last layer's wanted rows), over
        the same slots (as the native stack selects its masks' rows)."""
        return LoraBatch(self.weights, self.slots[rows], self.lo, self.hi, self.packed)

    def delta(self, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> the adapters' addition to projection ``proj`` of layer ``layer``:
        [T, out] in x's dtype. Per part k, ``(x A^T * M)_k B_k^T``: B's parts are read
        separately (a block-diagonal B would read zeros: 2/3 of a fused qkv's)."""
        p = self.weights.stacks[layer][proj]
        R, n_parts, lo, hi = self.weights.max_rank, len(p.rows), self.lo, self.hi
        if self.packed:
            a, bs = self.weights.packed[layer, proj]
            linear = _packed_linear
        else:
            a, bs = p.a[lo * n_parts * R:hi * n_parts * R], [b[:, lo * R:hi * R] for b in p.b]
            linear = F.linear
        h = linear(x.to(p.a.dtype).contiguous(), a) * self._mask(n_parts)
        if n_parts == 1:
            return linear(h, bs[0]).to(x.dtype)
        h = h.view(-1, hi - lo, n_parts, R)
        return torch.cat([linear(h[:, :, k].reshape(-1, (hi - lo) * R), b)
                          for k, b in enumerate(bs)], dim=1).to(x.dtype)

    def native_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], int, bool]:
        """The pass as ``sgl_cpu::DecoderStack.forward_lora`` takes it: per layer, each
        projection's A then its parts' B (11 tensors a layer), the masks of 1, 2 and 3 parts,
        the rank and whether the factors are oneDNN-reordered."""
        w = self.weights
        key = (self.lo, self.hi, self.packed)
        flat = w.flat.get(key)
        if flat is None:
            R, flat = w.max_rank, []
            for layer, per in enumerate(w.stacks):
                for proj in PROJECTIONS:
                    p = per[proj]
                    n = len(p.rows)
                    if self.packed:
                        a, bs = w.packed[layer, proj]
                        flat += [a, *bs]
                    else:
                        flat += [p.a[self.lo * n * R:self.hi * n * R],
                                 *(b[:, self.lo * R:self.hi * R] for b in p.b)]
            w.flat[key] = flat
        return flat, [self._mask(n) for n in (1, 2, 3)], w.max_rank, self.packed

    def _mask(self, n_parts: int) -> torch.Tensor:
        """[T, (hi - lo) * n_parts * R]: 1 where a column belongs to the row's slot."""
        mask = self._masks.get(n_parts)
        if mask is None:
            col_slot = torch.arange(self.lo, self.hi, device=self.slots.device)
            col_slot = col_slot.repeat_interleave(n_parts * self.weights.max_rank)
            mask = self._masks[n_parts] = (self.slots[:, None] == col_slot[None, :]).to(
                self.weights.dtype)
        return mask


def _packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ a oneDNN-reordered weight [out, in]^T -> [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@dataclass(frozen=True)
class LoadedLora:
    """A served adapter: its ``slot`` in :class:`LoraWeights`, its radix-cache ``namespace``
    (name and weights digest), ``path`` and ``rank``."""

    name: str
    slot: int
    namespace: str
    path: str
    rank: int


class LoraRegistry:
    """Adapter names -> slots, for the engine. ``weights`` None: LoRA is off (every name is
    unknown). ``model``: the runner's model (adapters are checked against it)."""

    def __init__(self, weights: LoraWeights | None, model):
        self.weights, self.model = weights, model
        self.loaded: dict[str, LoadedLora] = {}

    def names(self) -> list[str]:
        """The served adapters' names, in load order."""
        return list(self.loaded)

    def served(self) -> dict[str, str]:
        """The served adapters: name -> path, in load order."""
        return {a.name: a.path for a in self.loaded.values()}

    def load(self, name: str, path: str) -> LoadedLora:
        """Read the PEFT adapter at ``path`` and serve it as ``name``. Raises LoraError: LoRA
        off, the name taken, every slot in use, or the adapter refused
        (:func:`server.model.lora_files.read_adapter`)."""
        if self.weights is None:
            raise LoraError("LoRA is off: start the server with --lora-paths or --enable-lora")
        if not name or name in self.loaded:
            raise LoraError(f"adapter name {name!r} is {'taken' if name else 'empty'}")
        free = sorted(set(range(self.weights.slots)) - {a.slot for a in self.loaded.values()})
        if not free:
            raise LoraError(f"all {self.weights.slots} LoRA slots are in use: unload an "
                            "adapter or raise --max-loras-per-batch")
        adapter = read_adapter(name, path, self.model)
        self.weights.load(free[0], adapter)
        entry = LoadedLora(name, free[0], f"lora:{name}:{adapter.digest}", path, adapter.rank)
        self.loaded[name] = entry
        return entry

    def unload(self, name: str, busy_slots: Iterable[int]) -> None:
        """Stop serving ``name`` and free its slot. Raises KeyError for an unknown name and
        LoraBusyError while requests in ``busy_slots`` (the slots of queued and running
        requests) use it."""
        entry = self.loaded[name]
        if entry.slot in set(busy_slots):
            raise LoraBusyError(f"adapter {name!r} has requests in flight; unload it when they "
                            "finish")
        del self.loaded[name]
        self.weights.clear(entry.slot)

    def resolve(self, name: str | None) -> LoadedLora | None:
        """The adapter a request names (None: the base model). Raises KeyError for an unknown
        name."""
        return None if name is None else self.loaded[name]
