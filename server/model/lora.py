"""Multi-LoRA in one forward pass: the runner's adapter slots (:class:`LoraWeights`) and the
per-pass row-to-adapter map (:class:`LoraBatch`); names -> slots are
:mod:`server.model.lora_registry`'s.

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

Three ways to run it, picked per pass by :meth:`LoraBatch.of` (the native decoder stack runs
the same one, so its outputs are bitwise the Python loop's):
  * "sgmv" (up to SGMV_MAX_ROWS rows, where the native kernels are built): each row reads only
    its own adapter's factors (``sgl_cpu::lora_sgmv_``, Punica's segmented gather
    matrix-vector product): a decode step reads each adapter once and wastes no work on the
    other slots' columns;
  * "packed": bf16 on CPU, the masked matmuls on oneDNN-reordered factors of every loaded slot
    (1.4-1.8x the plain matmul's bandwidth at 16 rows), where the pass spans half of them;
  * "plain": the masked matmuls over the slots the pass spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from server.model.lora_files import PROJECTIONS, LoraAdapter, LoraError

SGMV_MAX_ROWS = 64  # passes of more rows (prefill) run the masked matmuls


@dataclass
class LoraProjection:
    """One projection's slots. ``a``: [slots * parts * R, in], rows (slot, part, rank) in that
    order; ``bt``: per part k, B^T [slots * R, rows_k], rows (slot, rank); ``rows``: (first
    row, rows) of each part in the projection's output (q, k, v; gate, up; or the whole)."""

    a: torch.Tensor
    bt: list[torch.Tensor]
    rows: list[tuple[int, int]]


class LoraWeights:
    """The stacked A and B factors of ``slots`` adapter slots for ``model`` (a loaded
    :class:`server.model.llama.LlamaForCausalLM`), in ``dtype`` on ``device``. Memory:
    slots * max_rank * (parts * in + out) elements per projection (twice that for the
    slots in use where "packed" copies are kept).

    Args: max_rank: the largest r a slot takes (R)."""

    def __init__(self, model, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.slots, self.max_rank, self.dtype = slots, max_rank, dtype
        self.stacks: list[dict[str, LoraProjection]] = []
        self.used: set[int] = set()
        self.packed: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.packed_slots = 0  # "packed" copies cover slots [0, packed_slots)
        self._stale = False  # slots changed since the copies were made
        # LoraBatch.native_args's tensor lists, by (lo, hi, mode); emptied by _repack
        self.flat: dict[tuple[int, int, str], list[torch.Tensor]] = {}
        cpu = torch.device(device).type == "cpu"
        self._pack = dtype == torch.bfloat16 and cpu and torch.backends.mkldnn.is_available()
        self.sgmv = cpu and dtype in (torch.float32, torch.bfloat16) and _sgmv_built()
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
                    [torch.zeros(slots * max_rank, n, dtype=dtype, device=device)
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
                p.bt[k][slot * R:slot * R + r] = \
                    part.b[first - part.offset:first - part.offset + rows].t().to(self.dtype)
        self.used.add(slot)
        self._stale = True

    def clear(self, slot: int) -> None:
        """Zero ``slot``'s factors (an unloaded adapter)."""
        R = self.max_rank
        for per in self.stacks:
            for p in per.values():
                n_parts = len(p.rows)
                p.a[slot * n_parts * R:(slot + 1) * n_parts * R] = 0
                for bt in p.bt:
                    bt[slot * R:(slot + 1) * R] = 0
        self.used.discard(slot)
        self._stale = True

    def ensure_packed(self) -> int:
        """``packed_slots``, the reordered copies first brought up to date when slots changed
        since they were made (once, at the first pass after any number of loads)."""
        if self._stale:
            self._stale = False
            self._repack()
        return self.packed_slots

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
                        [reorder(bt[:n * R].t().contiguous()) for bt in p.bt])
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
    """Which slot each row of one pass uses, and how the pass runs (module docstring).
    ``slots``: [T] int64 (-1: none); the masked modes compute the columns of slots
    [lo, hi)."""

    weights: LoraWeights
    slots: torch.Tensor
    lo: int
    hi: int
    mode: str = "plain"  # "sgmv", "packed" or "plain"
    _masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, weights: LoraWeights, slots: torch.Tensor) -> "LoraBatch | None":
        """None when no row of ``slots`` has an adapter."""
        used = slots[slots >= 0]
        if used.numel() == 0:
            return None
        lo, hi, n = int(used.min()), int(used.max()) + 1, weights.ensure_packed()
        if weights.sgmv and slots.numel() <= SGMV_MAX_ROWS:
            return cls(weights, slots.contiguous(), lo, hi, "sgmv")
        if n and hi <= n and 2 * (hi - lo) >= n:  # the reordered matmul reads the other
            return cls(weights, slots, 0, n, "packed")  # slots' masked factors, and wins
        return cls(weights, slots, lo, hi)

    def take(self, rows: torch.Tensor) -> "LoraBatch":
        """The batch of rows ``rows`` ([N] int64) only (the last layer's wanted rows), over
        the same slots and mode (as the native stack selects its masks' rows)."""
        return LoraBatch(self.weights, self.slots[rows], self.lo, self.hi, self.mode)

    def add_to(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the adapters' addition to projection ``proj`` of layer ``layer``, for x [T, in]
        and its output y [T, out] (updated in place in "sgmv" mode). Returns [T, out] in y's
        dtype."""
        p = self.weights.stacks[layer][proj]
        if self.mode == "sgmv":
            torch.ops.sgl_cpu.lora_sgmv_(y, x.contiguous(), self.slots, p.a, p.bt,
                                         self.weights.max_rank)
            return y
        R, n_parts, lo, hi = self.weights.max_rank, len(p.rows), self.lo, self.hi
        if self.mode == "packed":
            a, bs = self.weights.packed[layer, proj]
            linear = _packed_linear
        else:
            a, bs = p.a[lo * n_parts * R:hi * n_parts * R], [bt[lo * R:hi * R].t()
                                                             for bt in p.bt]
            linear = F.linear
        h = linear(x.to(p.a.dtype).contiguous(), a) * self._mask(n_parts)
        if n_parts == 1:
            return y + linear(h, bs[0]).to(y.dtype)
        h = h.view(-1, hi - lo, n_parts, R)
        return y + torch.cat([linear(h[:, :, k].reshape(-1, (hi - lo) * R), b)
                              for k, b in enumerate(bs)], dim=1).to(y.dtype)

    def native_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int,
                                   int]:
        """The pass as ``sgl_cpu::DecoderStack.forward_lora`` takes it: per layer, each
        projection's A then its parts' B (11 tensors a layer: whole slot stacks for "sgmv",
        [out, in] weights for the masked modes), the masks of 1, 2 and 3 parts (none for
        "sgmv"), the slots, the rank and the mode (0 plain, 1 packed, 2 sgmv)."""
        w, R = self.weights, self.weights.max_rank
        key = (self.lo, self.hi, self.mode)
        flat = w.flat.get(key)
        if flat is None:
            flat = []
            for layer, per in enumerate(w.stacks):
                for proj in PROJECTIONS:
                    p, n = per[proj], len(per[proj].rows)
                    if self.mode == "sgmv":
                        flat += [p.a, *p.bt]
                    elif self.mode == "packed":
                        a, bs = w.packed[layer, proj]
                        flat += [a, *bs]
                    else:
                        flat += [p.a[self.lo * n * R:self.hi * n * R],
                                 *(bt[self.lo * R:self.hi * R].t() for bt in p.bt)]
            w.flat[key] = flat
        masks = [] if self.mode == "sgmv" else [self._mask(n) for n in (1, 2, 3)]
        return flat, masks, self.slots, R, ("plain", "packed", "sgmv").index(self.mode)

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


def _sgmv_built() -> bool:
    """Whether ``sgl_cpu::lora_sgmv_`` is there (the native kernels, built at install)."""
    from kernels import cpu as native

    return native.available() and hasattr(torch.ops.sgl_cpu, "lora_sgmv_")
