"""The scheduler process's memory allocator on CPU: tcmalloc where the OS has it.

Why: a CPU decode step allocates a few thousand small buffers (tensor headers, kernel
scratch, the scheduler's and the grammar's objects: ~1,800 mallocs under 1 KB and ~260
64-byte-aligned ones of 1-64 KB a step, counted with uprobes on a jump-forward run), and
glibc's malloc spent ~2% of that run's samples in ``_int_malloc``/``malloc_consolidate``.
With ``libtcmalloc_minimal.so.4`` preloaded into the scheduler process (2-core Zen 5,
2026-11-27, interleaved A/B of in-process engines): constrained JSON decoding at 4 in flight
+6.1% with jump-forward on and +4.4% off, the peers' decode at 16 streams +4% (median of 3
server starts each), noshare prefill unchanged. vLLM-cpu and SGLang's CPU images preload it
too (their docs: ``LD_PRELOAD``); it is a system library (Debian: libtcmalloc-minimal4), not
on PyPI, so it is used where present and never installed.

The preload is an environment variable read when a process starts, so the HTTP process sets
it for the scheduler process it spawns (:func:`malloc_env`); the HTTP process keeps its own
allocator. Only for CPU serving: with ``--device auto`` it is skipped where an NVIDIA driver is
loaded (this module must not import torch to ask).
"""

from __future__ import annotations

import ctypes.util
import os

from server.options import ConfigError

MALLOC_MODES = ("auto", "tcmalloc", "system")
TCMALLOC = "tcmalloc_minimal"  # the library name: libtcmalloc_minimal.so.4 on Debian/Ubuntu


def find_tcmalloc() -> str | None:
    """The soname of the OS's tcmalloc (``libtcmalloc_minimal.so.4``), as the dynamic loader
    finds it for ``LD_PRELOAD``; None where it is not installed."""
    return ctypes.util.find_library(TCMALLOC)


def nvidia_driver_loaded(path: str = "/proc/driver/nvidia/version") -> bool:
    """Whether an NVIDIA driver is loaded (``--device auto`` would then pick CUDA)."""
    return os.path.exists(path)


def malloc_env(mode: str, device: str, environ: dict[str, str] | None = None,
               find=find_tcmalloc, gpu=nvidia_driver_loaded) -> dict[str, str]:
    """Environment additions for the scheduler process under ``--cpu-malloc mode``:
    ``{"LD_PRELOAD": ...}`` with tcmalloc first where it is used, else {}.

    ``mode`` is one of MALLOC_MODES (:class:`server.model_config.ModelConfig` checks it).
    "auto": tcmalloc when found and ``device`` is "cpu", or "auto" without an NVIDIA driver;
    "tcmalloc": the same but required (ConfigError when not found), on any device; "system":
    never. A user's own LD_PRELOAD is kept, after tcmalloc (already listing it: unchanged)."""
    if mode == "system":
        return {}
    if mode == "auto" and (device not in ("cpu", "auto") or (device == "auto" and gpu())):
        return {}
    lib = find()
    if lib is None:
        if mode == "tcmalloc":
            raise ConfigError("--cpu-malloc tcmalloc: libtcmalloc_minimal is not installed "
                              "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")
        return {}
    current = (os.environ if environ is None else environ).get("LD_PRELOAD", "")
    if TCMALLOC in current:
        return {}
    return {"LD_PRELOAD": f"{lib} {current}".strip()}
