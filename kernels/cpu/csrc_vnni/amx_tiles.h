// The AMX tile state both AMX kernels (amx_linear.cpp, attention_amx.cpp) use: whether this
// process may run tile instructions, and the one tile configuration they load.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sgl_cpu_vnni {

// True where the CPU has AMX-TILE, AMX-BF16, AVX512-BF16 and AVX512-VBMI and Linux granted this
// process the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM; asked once; amx_linear.cpp).
bool amx_available();

// Palette 1, all 8 tiles 16 rows x 64 bytes (Intel's AMX programming reference, "TILECFG").
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Loads TileConfig into this thread's tile registers. Each work item calls it: other code in
// the process (oneDNN's GEMMs) may change or release the tiles between items.
__attribute__((target("amx-tile"))) inline void load_tile_config() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

}  // namespace sgl_cpu_vnni
