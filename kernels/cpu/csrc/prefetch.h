// Software prefetch of data streamed from DRAM (K/V rows in attention, weight blocks in the
// VNNI linear kernels), into L1 or L2 by the CPU: one decision per machine, read once per call
// by each kernel (a hint never changes a result). Internal linkage: the two libraries are
// compiled for different instruction sets and must not share symbols.
#pragma once

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

namespace sgl_cpu {
namespace {

// Whether streamed data is prefetched into L2 (prefetcht1) rather than L1 (prefetcht0): on AMD
// family 19h (Zen 3 / Zen 4). Measured on a 2-core Zen 4: decode attention over DRAM-resident
// bf16 K/V (benchmarks.cpu_attention --layers 30, shuffled slots) 16 x (512 + 1) 0.58 -> 0.28
// ms a layer, 1 x (4096 + 1) 0.29 -> 0.13, extends unchanged; one row through the default
// model's 120 int4 linears from DRAM 18-22 -> 22-25 GB/s; prefills unchanged; again 2026-11-28
// in the engine, one stream after 4,096 tokens 108-119 tok/s against 74-76 into L1. Into L1 the
// misses in flight stalled on the L1's miss buffers. On Zen 5 (family 1Ah) L1 measured faster (docs/benchmarks.md,
// "Engine"; again 2026-11-28: 1 x 4,096 decode from DRAM 0.086-0.091 ms a layer into L1,
// 0.091-0.097 into L2), and nothing was measured elsewhere, so L1 stays the default.
// SGL_CPU_PREFETCH=l1|l2 overrides the choice (read once a process), so both paths run and are
// tested on any machine; any other value is an error at the first kernel call.
inline bool prefetch_into_l2() {
  static const bool l2 = [] {
    if (const char* level = std::getenv("SGL_CPU_PREFETCH"); level && *level) {  // the override
      TORCH_CHECK(!std::strcmp(level, "l1") || !std::strcmp(level, "l2"),
                  "SGL_CPU_PREFETCH must be l1 or l2, got '", level, "'");
      return level[1] == '2';
    }
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u)  // "Auth"enticAMD
      return false;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    unsigned family = (a >> 8) & 0xF;
    if (family == 0xF) family += (a >> 20) & 0xFF;
    return family == 0x19;
  }();
  return l2;
}

// Prefetch the cache line at p into L2 (l2) or L1.
inline __attribute__((always_inline)) void prefetch_line(const void* p, bool l2) {
  if (l2) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}

}  // namespace
}  // namespace sgl_cpu
