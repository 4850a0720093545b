"""Multi-LoRA in one forward pass: the runner's adapter slots (:class:`LoraWeights`), the
per-pass row-to-adapter map (:class:`LoraBatch`), and the engine's name -> slot registry
(:class:`LoraRegistry`).

Layout: for each layer and projection ``p`` (:data:`server.model.lora_files.PROJECTIONS`),
every slot owns ``R_p = max_rank * PARTS[p]`` columns (one block of ``max_rank`` per fused HF
projection, e.g. q, k and v): ``A_p`` [slots * R_p, in] stacks the slots' A factors, ``B_p``
[out, slots * R_p] their B factors (block-diagonal within a slot: q's B fills q's rows only),
scales folded in, zeros where a slot or a block is empty.

One pass over rows of several adapters (and of none: the base model) adds, per projection,
``((x A_p^T) * M) B_p^T`` where the mask M [T, slots * R_p] keeps each row's own slot's
columns: two dense matmuls and a product whatever the mix, so the op count does not grow with
the number of adapters (the segmented gather matmul of Punica / S-LoRA, Chen et al. 2023 and
Sheng et al. 2023, as one masked matmul pair; the columns span only the slots the pass uses).
Rows of no adapter get exact zeros added. A pass with no adapter rows skips all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F

from server.lora_config import LoraConfig
from server.model.lora_files import (
    PARTS,
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


class LoraWeights:
    """The stacked A and B factors of ``slots`` adapter slots for ``model`` (a loaded
    :class:`server.model.llama.LlamaForCausalLM`), in ``dtype`` on ``device``.

    Args: max_rank: the largest r a slot takes (tokens of rank, not bytes)."""

    def __init__(self, model, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.slots, self.max_rank, self.dtype = slots, max_rank, dtype
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = []
        for layer in model.layers:
            per: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
            for proj in PROJECTIONS:
                linear = getattr(layer, proj, None)
                if linear is None:  # a mixture-of-experts layer's MLP
                    continue
                rp = max_rank * PARTS[proj]
                per[proj] = (torch.zeros(slots * rp, linear.in_features, dtype=dtype,
                                         device=device),
                             torch.zeros(linear.out_features, slots * rp, dtype=dtype,
                                         device=device), rp)
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
        blocks: dict[tuple[int, str], int] = {}
        for part in sorted(adapter.parts, key=lambda p: (p.layer, p.proj, p.offset)):
            a, b, rp = self.stacks[part.layer][part.proj]
            block = blocks.get((part.layer, part.proj), 0)
            blocks[part.layer, part.proj] = block + 1
            lo, r = slot * rp + block * self.max_rank, part.a.shape[0]
            a[lo:lo + r] = part.a.to(self.dtype)
            b[part.offset:part.offset + part.rows, lo:lo + r] = part.b.to(self.dtype)

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s columns (an unloaded adapter)."""
        for per in self.stacks:
            for a, b, rp in per.values():
                a[slot * rp:(slot + 1) * rp] = 0
                b[:, slot * rp:(slot + 1) * rp] = 0

    def batch(self, token_slots: torch.Tensor) -> "LoraBatch | None":
        """The pass's :class:`LoraBatch` for ``token_slots`` ([T] int64, each row's slot, -1
        for the base model), or None when no row has an adapter."""
        return LoraBatch.of(self, token_slots)


@dataclass
class LoraBatch:
    """Which slot each row of one pass uses. ``slots``: [T] int64 (-1: none); columns of slots
    [lo, hi) take part."""

    weights: LoraWeights
    slots: torch.Tensor
    lo: int
    hi: int
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, weights: LoraWeights, slots: torch.Tensor) -> "LoraBatch | None":
        """None when no row of ``slots`` has an adapter."""
        used = slots[slots >= 0]
        if used.numel() == 0:
            return None
        return cls(weights, slots, int(used.min()), int(used.max()) + 1)

    def take(self, rows: torch.Tensor) -> "LoraBatch | None":
        """The batch of rows ``rows`` ([N] int64) only (the last layer's wanted rows)."""
        return LoraBatch.of(self.weights, self.slots[rows])

    def delta(self, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in] -> the adapters' addition to projection ``proj`` of layer ``layer``:
        [T, out] in x's dtype."""
        a, b, rp = self.weights.stacks[layer][proj]
        cols = slice(self.lo * rp, self.hi * rp)
        h = F.linear(x.to(a.dtype), a[cols]) * self._mask(rp)
        return F.linear(h, b[:, cols]).to(x.dtype)

    def _mask(self, rp: int) -> torch.Tensor:
        mask = self._masks.get(rp)
        if mask is None:
            col_slot = torch.arange(self.lo, self.hi, device=self.slots.device)
            mask = (self.slots[:, None] == col_slot.repeat_interleave(rp)[None, :])
            mask = self._masks[rp] = mask.to(self.weights.dtype)
        return mask


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
