// The packed weight layouts of the VNNI linear layers (vnni_linear.cpp computes with them,
// vnni_pack.cpp writes them).
//
// Packed layouts (one tile = 16 output features; N padded to a multiple of 16 with zeros):
//   int4: per tile, per block g: 16 fp16 d, 16 fp16 m, then 4 chunks of 64 bytes; in chunk c
//         byte 4f + j holds q[f][32g + 8c + j] (low nibble) and q[f][32g + 8c + 4 + j] (high
//         nibble), j = 0..3. 320 bytes per 512 weights (Q4_1's 0.625 bytes per weight).
//   int8: per tile, per block g: 8 chunks of 64 bytes; in chunk c byte 4f + j holds
//         u[f][32g + 4c + j] = w + 128.
#pragma once

#include <cstdint>

namespace sgl_cpu_vnni {
namespace {

constexpr int64_t QK = 32;          // inputs per block (weights' and activations' alike)
constexpr int64_t TILE = 16;        // output features per tile (one zmm of int32 lanes)
constexpr int64_t Q4_BLOCK = 320;   // bytes per (tile, block), int4
constexpr int64_t Q8_BLOCK = 512;   // bytes per (tile, block), int8

}  // namespace
}  // namespace sgl_cpu_vnni
