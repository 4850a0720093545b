"""What the CPU can do, as one ordered ISA level, with an override for tests and users.

Levels, each implying the ones before it:
  * ``"avx2"``: AVX2 + FMA (every x86-64 CPU this project targets; bf16 arithmetic emulated);
  * ``"avx512"``: AVX-512 F/BW/VL (Intel Skylake-SP and later, AMD Zen 4/5);
  * ``"avx512_vnni"``: plus AVX512-VNNI int8 dot products (Intel Cascade Lake / Ice Lake and
    later, AMD Zen 4/5): the quantized linear layers run on ``kernels.cpu``'s VNNI library;
  * ``"avx512_bf16"``: plus AVX512-BF16 dot products (AMD Zen 4/5, Intel Cooper Lake and later);
  * ``"amx"``: plus AMX-BF16/INT8 tile units (Intel Sapphire Rapids and later).
``"none"`` is a CPU below AVX2 (or not x86): the pure-torch paths only.

The override ``SGL_CPU_ISA=<level>`` makes :func:`cpu_isa` report that level. Use it to run a
lower class's code paths on a bigger machine (a test of the AVX2 path on an AMX machine), or
the decisions of a higher class (bf16 compute, which torch emulates where the CPU lacks it). A
native kernel still checks :func:`detected_isa` before it runs an instruction the machine lacks.
"""

from __future__ import annotations

import functools
import os

ISA_LEVELS = ("none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")
ENV_OVERRIDE = "SGL_CPU_ISA"
# the /proc/cpuinfo flags each level needs, on top of the previous level's
_NEEDS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl"),
    "avx512_vnni": ("avx512_vnni",),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_int8", "amx_tile"),
}


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags in ``cpuinfo_path`` (empty when unreadable)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_from_flags(flags: frozenset[str] | set[str]) -> str:
    """The highest level of :data:`ISA_LEVELS` whose flags (and every lower level's) are set."""
    level = "none"
    for name in ISA_LEVELS[1:]:
        if not all(f in flags for f in _NEEDS[name]):
            break
        level = name
    return level


@functools.lru_cache(maxsize=None)
def detected_isa(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """What this machine's CPU can execute (ignores the override)."""
    return isa_from_flags(cpu_flags(cpuinfo_path))


def cpu_isa(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The level the server plans for: ``$SGL_CPU_ISA`` when set, else :func:`detected_isa`.
    Raises ValueError for an override that is not one of :data:`ISA_LEVELS`."""
    forced = os.environ.get(ENV_OVERRIDE, "").strip()
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"{ENV_OVERRIDE} must be one of {ISA_LEVELS}, got {forced!r}")
        return forced
    return detected_isa(cpuinfo_path)


def at_least(level: str, isa: str | None = None) -> bool:
    """True when ``isa`` (default :func:`cpu_isa`) is ``level`` or above."""
    return ISA_LEVELS.index(isa or cpu_isa()) >= ISA_LEVELS.index(level)


def native_bf16(isa: str | None = None) -> bool:
    """bf16 dot products in hardware (AVX512-BF16 or AMX): then oneDNN's bf16 matmuls ran 1.8x
    (batch 1) to 6x (512 rows) faster than fp32 on a 2-core machine; without, bf16 is emulated
    and slower than fp32."""
    return at_least("avx512_bf16", isa)


def cpu_description(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """One line for benchmark reports: the CPU's model name, its detected class, the
    vector/matrix flags that decide the class (avx*, amx*, fma, f16c), and the logical CPU
    count the OS reports. An unreadable ``cpuinfo_path`` gives "unknown CPU; class none"."""
    name = "unknown CPU"
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = cpu_flags(cpuinfo_path)
    shown = sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return (f"{name}; class {detected_isa(cpuinfo_path)} ({' '.join(shown) or 'no AVX'}); "
            f"{os.cpu_count()} logical CPUs")
