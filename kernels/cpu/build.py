"""Build the sgl_cpu operator library (``python -m kernels.cpu.build``; ``make`` runs it at
install time, never the server at run time).

Two libraries, each compiled with torch's extension builder (ninja, the system C++ compiler):
  * ``kernels/cpu/csrc`` -> ``kernels/cpu/_build/sgl_cpu.so`` for AVX2 + FMA + F16C, which every
    CPU class this project targets (AVX2-only, AVX-512, AMX) executes;
  * ``kernels/cpu/csrc_vnni`` -> ``kernels/cpu/_build/vnni/sgl_cpu_vnni.so`` for AVX-512 F/BW/VL/DQ
    + VNNI. It is built on every machine (the compiler needs no such CPU) and loaded only on
    one that has them (:mod:`kernels.cpu`).
Re-running is cheap: ninja rebuilds only what changed. Exit status 1 with the compiler's
message when a build fails.
"""

from __future__ import annotations

import os
import sys

from kernels.cpu import HERE, LIBRARY, VNNI_LIBRARY

# -ffp-contract=off: a multiply and an add stay two roundings unless the source asks for an FMA.
# The kernels' results are defined by their operation chains (a token's attention output is
# bitwise the same in a decode step and in any extend, whatever the batch), and GCC's default
# for GNU C++ (fast) fuses wherever its inlining lets it: 104 such FMAs in the AVX2 attention,
# 248 in the AVX-512 one, 16 in the bf16 one, and an unrelated change to the attention driver
# (2026-11-28) fused differently in the decode and the extend instantiations, breaking
# test_attention_of_a_token_is_the_same_in_decode_and_in_any_extend. Engine throughput with
# and without, alternated (Zen 4): within the machine's noise.
CFLAGS = ["-O3", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG",
          "-ffp-contract=off"]
VNNI_CFLAGS = CFLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
# library path (its file name is the library's name) -> (source directory, compiler flags)
LIBRARIES = {LIBRARY: ("csrc", CFLAGS), VNNI_LIBRARY: ("csrc_vnni", VNNI_CFLAGS)}


def build(verbose: bool = False) -> list[str]:
    """Compile (or bring up to date) every library; returns their paths. Raises RuntimeError
    (torch's, with the compiler output) when compiling fails."""
    from torch.utils.cpp_extension import load

    for path, (src, cflags) in LIBRARIES.items():
        src_dir = os.path.join(HERE, src)
        sources = sorted(os.path.join(src_dir, f) for f in os.listdir(src_dir)
                         if f.endswith(".cpp"))
        build_dir, name = os.path.split(path)
        os.makedirs(build_dir, exist_ok=True)
        load(name=name.removesuffix(".so"), sources=sources, extra_cflags=cflags,
             extra_ldflags=["-fopenmp"], build_directory=build_dir, is_python_module=False,
             verbose=verbose)
    return list(LIBRARIES)


def main() -> int:
    try:
        paths = build(verbose="-v" in sys.argv)
    except (RuntimeError, OSError) as exc:
        print(f"building the sgl_cpu kernels failed: {exc}", file=sys.stderr)
        return 1
    print("built " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
