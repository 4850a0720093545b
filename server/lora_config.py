"""Multi-LoRA serving options (:class:`LoraConfig`): the PEFT adapters loaded at start-up and
the runner's adapter slots. Torch-free (the HTTP process and ``--help`` read it); the adapters
themselves are read by :mod:`server.model.lora_files` and applied by :mod:`server.model.lora`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from server.options import ConfigError, option


@dataclass(frozen=True)
class LoraConfig:
    """Attributes:
        lora_paths: adapters loaded at start-up, each "name=path" or a path (named after its
            directory): a PEFT directory (``adapter_config.json`` and
            ``adapter_model.safetensors``).
        max_loras_per_batch: the runner's adapter slots: every loaded adapter holds one, so
            this is how many may be loaded at once (all of them can share one batch).
        max_lora_rank: the largest rank a slot takes; 0 = the largest of ``lora_paths`` (16
            when none is given).
        enable_lora: keep slots for adapters loaded at run time (``/load_lora_adapter``)
            even when none is given at start-up.
    """

    lora_paths: tuple[str, ...] = option(
        (), "--lora-paths", "PEFT LoRA adapters to serve, each NAME=PATH or PATH (named after "
        "its directory); a request picks one by model (\"NAME\" or \"BASE:NAME\") or lora_path",
        nargs="+", type=str)
    max_loras_per_batch: int = option(
        8, "--max-loras-per-batch", "adapter slots: how many adapters may be loaded at once "
        "(any of them share a batch)")
    max_lora_rank: int = option(
        0, "--max-lora-rank", "the largest adapter rank a slot takes (0 = the largest of "
        "--lora-paths, 16 when none)")
    enable_lora: bool = option(
        False, "--enable-lora", "keep LoRA slots for adapters loaded at run time "
        "(/load_lora_adapter) even when --lora-paths gives none")

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths or ()))
        if self.max_loras_per_batch < 1:
            raise ConfigError("max_loras_per_batch must be >= 1")
        if self.max_lora_rank < 0:
            raise ConfigError("max_lora_rank must be >= 0")
        names = [name for name, _ in self.adapters()]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora_paths name an adapter twice: {names}")
        if len(names) > self.max_loras_per_batch:
            raise ConfigError(f"{len(names)} lora_paths but max_loras_per_batch is "
                                  f"{self.max_loras_per_batch}")

    @property
    def enabled(self) -> bool:
        """Whether the runner keeps LoRA slots."""
        return self.enable_lora or bool(self.lora_paths)

    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each start-up adapter."""
        out = []
        for entry in self.lora_paths:
            name, sep, path = entry.partition("=")
            if not sep:
                name, path = os.path.basename(os.path.normpath(entry)), entry
            if not name or not path:
                raise ConfigError(f"lora_paths entry {entry!r} is not NAME=PATH or PATH")
            out.append((name, path))
        return out
