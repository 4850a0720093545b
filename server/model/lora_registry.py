"""The engine's LoRA adapters by name (:class:`LoraRegistry`): which slot of the runner's
:class:`server.model.lora.LoraWeights` each holds, its radix-cache namespace, loading and
unloading; and the slots a config asks for (:func:`slot_shape`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from server.lora_config import LoraConfig
from server.model.lora import LoraWeights
from server.model.lora_files import LoraError, adapter_rank, read_adapter

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
            raise LoraBusyError(f"adapter {name!r} has requests in flight; unload it when "
                                "they finish")
        del self.loaded[name]
        self.weights.clear(entry.slot)

    def resolve(self, name: str | None) -> LoadedLora | None:
        """The adapter a request names (None: the base model). Raises KeyError for an unknown
        name."""
        return None if name is None else self.loaded[name]
