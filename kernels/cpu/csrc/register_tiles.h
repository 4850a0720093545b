// The register-tile dispatch both quantized linear libraries use (quant_linear.cpp,
// ../csrc_vnni/tile_loops.h): a tile kernel is compiled for each row count 1..MAX_TILE_ROWS,
// and with_rows picks it for a runtime count. Header-only with internal linkage, as
// work_ranges.h: the two libraries are compiled for different instruction sets.
#pragma once

#include <cstdint>

namespace sgl_cpu {
namespace {

constexpr int64_t MAX_TILE_ROWS = 6;  // activation rows per register tile

// Calls f.template operator()<NT, MT>() for a runtime mt (1..MAX_TILE_ROWS; larger takes
// MAX_TILE_ROWS).
template <int NT, typename F>
inline void with_rows(int64_t mt, F&& f) {
  switch (mt) {
    case 1: f.template operator()<NT, 1>(); break;
    case 2: f.template operator()<NT, 2>(); break;
    case 3: f.template operator()<NT, 3>(); break;
    case 4: f.template operator()<NT, 4>(); break;
    case 5: f.template operator()<NT, 5>(); break;
    default: f.template operator()<NT, 6>(); break;
  }
}

}  // namespace
}  // namespace sgl_cpu
