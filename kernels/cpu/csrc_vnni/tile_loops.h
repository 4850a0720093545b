// How the VNNI linear layers (vnni_linear.cpp) walk their output: register tiles of up to
// MAX_MT activation rows and 1, 2 or 4 feature tiles (with_tile), rows in cache blocks of MB,
// feature tiles (or gate/up tile pairs) in thread ranges with stealing at the ends
// (for_tiles, ../csrc/work_ranges.h). Which tile, block or thread computes an output never
// changes its bits.
#pragma once

#include <ATen/Parallel.h>

#include "../csrc/register_tiles.h"
#include "../csrc/work_ranges.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace sgl_cpu_vnni {
namespace {

constexpr int64_t MAX_MT = sgl_cpu::MAX_TILE_ROWS;  // activation rows per register tile
constexpr int64_t MB = 66;     // activation rows per cache block (a multiple of MAX_MT)

// Calls f.template operator()<NT, MT>() for runtime nt (1, 2 or 4) and mt (1..MAX_MT).
template <typename F>
inline void with_tile(int64_t nt, int64_t mt, F&& f) {
  if (nt == 4) sgl_cpu::with_rows<4>(mt, f);
  else if (nt == 2) sgl_cpu::with_rows<2>(mt, f);
  else sgl_cpu::with_rows<1>(mt, f);
}

// Runs tile(t0, nt, m0, mt) over [0, units) x [0, M): units (feature tiles, or gate/up tile
// pairs) split over threads in contiguous ranges, each range walked in groups of `group` units
// (4 or 2; fewer at its end), rows in cache blocks of MB and register tiles of MAX_MT. A
// range's items, (cache block, group) block by block, run through sgl_cpu::run_ranges
// (../csrc/work_ranges.h): a thread done early takes over items of one held up.
template <typename Tile>
void for_tiles(int64_t tiles, int64_t M, int64_t group, Tile tile) {
  const int64_t blocks = (M + MB - 1) / MB;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (tiles + group - 1) / group));
  // range r: units [lo, lo + len) in `full` groups, then the rest (< group <= 4) as a pair
  // and / or a single unit: `steps` in all. On the stack for up to 16 threads (a decode step
  // makes ~120 calls of a few microseconds).
  struct Range {
    int64_t lo, len, full, steps;
  };
  Range small[16];
  std::vector<Range> large(n > 16 ? n : 0);
  Range* ranges = n > 16 ? large.data() : small;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t lo = tiles * r / n, len = tiles * (r + 1) / n - lo, rest = len % group;
    ranges[r] = {lo, len, len / group, len / group + (rest >= 2) + rest % 2};
  }
  // ~3-4 us an item at prefill: the last 8 of a range stay with its owner
  sgl_cpu::run_ranges(n, [&](int64_t r) { return blocks * ranges[r].steps; }, 8,
                      [&](int64_t r, int64_t i) {
    const Range& g = ranges[r];
    const int64_t k = blocks == 1 ? i : i % g.steps, m0 = blocks == 1 ? 0 : (i / g.steps) * MB;
    int64_t t = g.lo + k * group, nt = group;
    if (k >= g.full) {  // the rest: 2 first (if 2 or 3 are left), then 1
      t = g.lo + g.full * group + (k > g.full ? 2 : 0);
      nt = (k == g.full && g.len % group >= 2) ? 2 : 1;
    }
    const int64_t m1 = std::min(M, m0 + MB);
    for (int64_t m = m0; m < m1; m += MAX_MT) tile(t, nt, m, std::min(MAX_MT, m1 - m));
  });
}

}  // namespace
}  // namespace sgl_cpu_vnni
