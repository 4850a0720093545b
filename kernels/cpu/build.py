"""Build the sgl_cpu operator library (``python -m kernels.cpu.build``; ``make`` runs it at
install time, never the server at run time).

The C++ sources in ``kernels/cpu/csrc`` are compiled with torch's extension builder (ninja, the
system C++ compiler) into ``kernels/cpu/_build/sgl_cpu.so`` for AVX2 + FMA + F16C, which every
CPU class this project targets (AVX2-only, AVX-512, AMX) executes. Re-running is cheap: ninja
rebuilds only what changed. Exit status 1 with the compiler's message when the build fails.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = sorted(os.path.join(HERE, "csrc", f) for f in os.listdir(os.path.join(HERE, "csrc"))
                 if f.endswith(".cpp"))
BUILD_DIR = os.path.join(HERE, "_build")
LIBRARY = os.path.join(BUILD_DIR, "sgl_cpu.so")
CFLAGS = ["-O3", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"]


def build(verbose: bool = False) -> str:
    """Compile (or bring up to date) the library; returns its path. Raises RuntimeError
    (torch's, with the compiler output) when compiling fails."""
    from torch.utils.cpp_extension import load

    os.makedirs(BUILD_DIR, exist_ok=True)
    load(name="sgl_cpu", sources=SOURCES, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
         build_directory=BUILD_DIR, is_python_module=False, verbose=verbose)
    return LIBRARY


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except (RuntimeError, OSError) as exc:
        print(f"building the sgl_cpu kernels failed: {exc}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
