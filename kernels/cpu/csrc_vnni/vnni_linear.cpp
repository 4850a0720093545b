// Weight-quantized linear layers on AVX-512 VNNI integer dot products (sgl_cpu_vnni::*): the
// activations are quantized per row in blocks of 32 to int8 (scale amax / 127, round to
// nearest even), and each block's products with the weights are summed exactly in int32 by
// vpdpbusd (64 byte products per instruction); the block sums are then scaled in float32.
// This is llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 scheme (ggml-quants.c, ggml_vec_dot_q4_1_q8_1),
// laid out for many output features at once: a 16-lane int32 accumulator holds 16 output
// features (one lane each) of one activation row, fed 4 inputs at a time from a broadcast
// dword of the activation row, as in oneDNN's / SGLang's VNNI GEMM packing ([K/4][N][4]).
// So no horizontal sum is needed and the per-block float work (convert, scale, add) is done
// once per 8 vpdpbusd of 16 features.
//
// Math, per activation row x and output feature n (b: block of 32 inputs):
//   x_k ~ dx_b * qx_k (qx in [-127, 127]),  Sx_b = sum_k qx_k,
//   int4:  w_k = d_b * q_k + m_b (q in [0, 15]):
//          y = sum_b [ (d_b * dx_b) * sum_k q_k qx_k + m_b * (dx_b * Sx_b) ]
//   int8:  w_k = s * (u_k - 128) (u = w + 128 in [1, 255], one scale s per feature):
//          y = s * sum_b dx_b * (sum_k u_k qx_k - 128 * Sx_b)
// The integer sums are exact; the float terms are added block by block in k order.
//
// Batch invariance: a row's quantization reads only that row, and y[m, n] is one float lane
// fed by the same operations in the same order whatever M is, which row tile or feature tile
// it falls in and how the features are split over threads (integer partial sums are exact, so
// how they are split over accumulators does not matter). A row's result never depends on the
// other rows of the batch.
//
// Packed layouts: packed_layout.h (written by vnni_pack.cpp).
//
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni into its own library
// (kernels/cpu/build.py), which kernels/cpu/__init__.py loads only on a CPU that has them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "../csrc/linear_inputs.h"
#include "../csrc/prefetch.h"
#include "packed_layout.h"
#include "quantize_rows.h"
#include "tile_loops.h"
#include "vec512.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace sgl_cpu_vnni {
namespace {

constexpr int64_t PREFETCH = 4;     // weight blocks prefetched ahead of the one computed (into
                                    // L1 or L2: ../csrc/prefetch.h)

using sgl_cpu::lanes;
using sgl_cpu::load16;
using sgl_cpu::store16;

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// y[m0 .. m0+MT, 16 NT features] for the int4 tiles w[0 .. NT). With SILU the tiles are
// (gate, up) pairs and y gets silu(gate) * up, 16 NT / 2 features: the values
// sgl_cpu_vnni::silu_mul gives on the unfused output (both rounded to T first; with NATIVE,
// by the CPU's bf16 conversion: the same bits for normal values, native_bf16_rounding).
// next: the weight streams of the group its thread most likely computes next (nullptr where
// there is none): their first PREFETCH blocks are prefetched during this group's last ones,
// so a new group does not start on DRAM misses (a 576-input weight has only 18 blocks a tile).
template <int NT, int MT, bool SILU, typename T, bool NATIVE = false>
inline void q4_tile(const uint8_t* const (&w)[NT], const uint8_t* const (&next)[NT], int64_t G,
                    const int8_t* qx, const float* dx, const float* cx, int64_t K, T* y,
                    int64_t ldy, int64_t n_valid, bool l2) {
  __m512 facc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < MT; ++r) facc[i][r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    // One int32 accumulator per (tile, row) takes both nibbles' products: the block sum is
    // exact whatever the order, and the freed registers hold more rows per weight unpacked.
    __m512i acc[NT][MT];
    for (int i = 0; i < NT; ++i)
      for (int r = 0; r < MT; ++r) acc[i][r] = _mm512_setzero_si512();
    if (g + PREFETCH < G) {  // the NT weight streams, PREFETCH blocks ahead
      for (int i = 0; i < NT; ++i)
        for (int line = 0; line < Q4_BLOCK; line += 64)
          sgl_cpu::prefetch_line(w[i] + (g + PREFETCH) * Q4_BLOCK + line, l2);
    } else {  // then the next group's first blocks
      for (int i = 0; i < NT; ++i)
        if (next[i] != nullptr)
          for (int line = 0; line < Q4_BLOCK; line += 64)
            sgl_cpu::prefetch_line(next[i] + (g + PREFETCH - G) * Q4_BLOCK + line, l2);
    }
    for (int c = 0; c < 4; ++c) {
      __m512i lo[NT], hi[NT];
      for (int i = 0; i < NT; ++i) {
        const __m512i v = _mm512_loadu_si512(w[i] + g * Q4_BLOCK + 64 + 64 * c);
        lo[i] = _mm512_and_si512(v, low);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < MT; ++r) {
        const int8_t* xr = qx + r * K + g * QK + 8 * c;
        const __m512i xa = bcast4(xr), xb = bcast4(xr + 4);
        for (int i = 0; i < NT; ++i) {
          acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], lo[i], xa);
          acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], hi[i], xb);
        }
      }
    }
    for (int i = 0; i < NT; ++i) {
      const uint8_t* b = w[i] + g * Q4_BLOCK;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
      for (int r = 0; r < MT; ++r) {
        const __m512 isum = _mm512_cvtepi32_ps(acc[i][r]);
        facc[i][r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g])),
                                     facc[i][r]);
        facc[i][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(cx[r * G + g]), facc[i][r]);
      }
    }
  }
  if constexpr (SILU) {
    for (int r = 0; r < MT; ++r)
      for (int j = 0; j < NT / 2; ++j) {
        const __m512 v = sgl_cpu::silu_times<T, NATIVE>(sgl_cpu::round_to<T, NATIVE>(facc[2 * j][r]),
                                                        sgl_cpu::round_to<T, NATIVE>(facc[2 * j + 1][r]));
        sgl_cpu::store16_as<NATIVE>(y + r * ldy + j * TILE, v);
      }
  } else {
    for (int r = 0; r < MT; ++r)
      for (int i = 0; i < NT; ++i) {
        const int64_t n = std::min<int64_t>(TILE, n_valid - i * TILE);
        if (n == TILE) store16(y + r * ldy + i * TILE, facc[i][r]);
        else if (n > 0) store16(y + r * ldy + i * TILE, facc[i][r], lanes(n));
      }
  }
}

// The whole of the next group's weights into L2, before the second row tile of a
// decode-sized pass (whose own weights then come from the cache), so that the next group's
// first row tile does not wait on DRAM: M = 8 / 16 rows through the default model's linears
// from DRAM 1.08x / 1.05x, JSON decoding +2-4%. Not in prefills, whose weights are reused from
// L2 across cache blocks of rows. Measured and not kept: the same spread over the block loop,
// one block a step (a runtime flag there cost prefills 2-3%; as a template parameter, M = 8 /
// 16 1.14x / 1.16x alone but JSON decoding 0.98x).
template <int NT>
inline void prefetch_group(const uint8_t* const (&next)[NT], int64_t G) {
  for (int i = 0; i < NT; ++i)
    if (next[i] != nullptr)
      for (int64_t line = 0; line < G * Q4_BLOCK; line += 64)
        sgl_cpu::prefetch_line(next[i] + line, true);
}

// next_tiles: how many of the NT tiles after these (the group its thread most likely computes
// next, contiguous in w) get their first PREFETCH blocks prefetched during this group's last
// ones, as q4_tile's next.
template <int NT, int MT, typename T>
inline void q8_tile(const uint8_t* w, int64_t tile_bytes, int64_t G, const int8_t* qx,
                    const float* dx, const int32_t* sx, int64_t K, const float* scale, T* y,
                    int64_t ldy, int64_t n_valid, int64_t next_tiles, bool l2) {
  __m512 facc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < MT; ++r) facc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[NT][MT];  // one per (tile, row), as q4_tile's
    for (int i = 0; i < NT; ++i)
      for (int r = 0; r < MT; ++r) acc[i][r] = _mm512_setzero_si512();
    if (g + PREFETCH < G) {
      for (int i = 0; i < NT; ++i)
        for (int line = 0; line < Q8_BLOCK; line += 64)
          sgl_cpu::prefetch_line(w + i * tile_bytes + (g + PREFETCH) * Q8_BLOCK + line, l2);
    } else {
      for (int i = 0; i < NT && i < next_tiles; ++i)
        for (int line = 0; line < Q8_BLOCK; line += 64)
          sgl_cpu::prefetch_line(w + (NT + i) * tile_bytes + (g + PREFETCH - G) * Q8_BLOCK + line, l2);
    }
    for (int c = 0; c < 8; c += 2) {
      __m512i u0[NT], u1[NT];
      for (int i = 0; i < NT; ++i) {
        const uint8_t* b = w + i * tile_bytes + g * Q8_BLOCK + 64 * c;
        u0[i] = _mm512_loadu_si512(b);
        u1[i] = _mm512_loadu_si512(b + 64);
      }
      for (int r = 0; r < MT; ++r) {
        const int8_t* xr = qx + r * K + g * QK + 4 * c;
        const __m512i xa = bcast4(xr), xb = bcast4(xr + 4);
        for (int i = 0; i < NT; ++i) {
          acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], u0[i], xa);
          acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], u1[i], xb);
        }
      }
    }
    for (int r = 0; r < MT; ++r) {
      const __m512i corr = _mm512_set1_epi32(128 * sx[r * G + g]);
      const __m512 d = _mm512_set1_ps(dx[r * G + g]);
      for (int i = 0; i < NT; ++i) {
        const __m512i isum = _mm512_sub_epi32(acc[i][r], corr);
        facc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, facc[i][r]);
      }
    }
  }
  for (int i = 0; i < NT; ++i) {
    const int64_t n = std::min<int64_t>(TILE, n_valid - i * TILE);
    if (n <= 0) continue;
    __m512 s;
    if (n == TILE) s = _mm512_loadu_ps(scale + i * TILE);
    else s = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), scale + i * TILE);
    for (int r = 0; r < MT; ++r) {
      const __m512 v = _mm512_mul_ps(facc[i][r], s);
      if (n == TILE) store16(y + r * ldy + i * TILE, v);
      else store16(y + r * ldy + i * TILE, v, lanes(n));
    }
  }
}

void check_packed(const at::Tensor& packed, int64_t N, int64_t tile_bytes, const char* packer) {
  const int64_t tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == tiles && packed.size(1) == tile_bytes &&
              packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "packed must be a contiguous [", tiles, ", ", tile_bytes, "] uint8 tensor "
              "(sgl_cpu_vnni.", packer, " of a [", N, ", K] weight)");
}

// y [M, N] in x's dtype: x quantized, then tile.template operator()<NU, MT, T>(u, m0, q,
// y + m0 * N + u * TILE) over every (group of NU units, row tile) of for_tiles; a unit is 16
// output features (one feature tile, or with a fused SiLU a gate/up tile pair).
template <typename Tile>
at::Tensor run_linear(const at::Tensor& x, int64_t N, int64_t group_of_one_row,
                      int64_t group, Tile&& tile) {
  const int64_t M = x.size(0), K = x.size(1), units = (N + TILE - 1) / TILE;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto run = [&](auto* xp, auto* yp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    const QuantizedRows q = quantize_rows(xp, M, K);
    for_tiles(units, M, M == 1 ? group_of_one_row : group,
              [&](int64_t u, int64_t nu, int64_t m0, int64_t mt) {
      with_tile(nu, mt, [&]<int NU, int MTI>() {
        tile.template operator()<NU, MTI, T>(u, m0, q, yp + m0 * N + u * TILE);
      });
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), y.data_ptr<float>());
  else run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace

// x [M, K] float32/bfloat16, packed from pack_int4 -> y [M, N] in x's dtype.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t K = x.size(1), G = K / QK, tile_bytes = G * Q4_BLOCK;
  sgl_cpu::check_x(x, K, QK);
  check_packed(packed, N, tile_bytes, "pack_int4");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const bool l2 = sgl_cpu::prefetch_into_l2();
  const int64_t units = (N + TILE - 1) / TILE;
  const bool decode_sized = x.size(0) <= MB;  // one cache block of rows
  return run_linear(x, N, 4, 2, [&]<int NT, int MT, typename T>(int64_t t, int64_t m0,
                                                                 const QuantizedRows& q, T* y) {
    const uint8_t* tiles[NT];
    const uint8_t* next[NT];  // the group after this one (a thread's range is contiguous)
    for (int i = 0; i < NT; ++i) {
      tiles[i] = w + (t + i) * tile_bytes;
      next[i] = t + NT + i < units ? w + (t + NT + i) * tile_bytes : nullptr;
    }
    if (decode_sized && m0 == MAX_MT) prefetch_group(next, G);
    q4_tile<NT, MT, false, T>(tiles, next, G, q.qx + m0 * K, q.dx + m0 * G, q.cx + m0 * G, K,
                              y, N, N - t * TILE, l2);
  });
}

// x [M, K] float32/bfloat16, packed from pack_int4 of a fused [gate; up] weight [2 I, K]
// (I a multiple of 16) -> silu(x @ gate.T) * (x @ up.T) [M, I] in x's dtype: bitwise
// silu_mul(int4_linear(x, packed, 2 I)), without the [M, 2 I] intermediate (gate tile p and up
// tile I / 16 + p are computed together and combined in registers; with native_bf16_rounding
// the same bits except denormals and NaN payloads).
at::Tensor int4_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t K = x.size(1), G = K / QK, tile_bytes = G * Q4_BLOCK, I = N / 2;
  sgl_cpu::check_x(x, K, QK);
  TORCH_CHECK(N % (2 * TILE) == 0, "int4_linear_silu: N = 2 I needs I a multiple of ", TILE,
              ", got N = ", N);
  check_packed(packed, N, tile_bytes, "pack_int4");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t up = I / TILE;  // the first up tile
  const bool native = sgl_cpu::native_bf16_rounding();
  const bool l2 = sgl_cpu::prefetch_into_l2();
  const bool decode_sized = x.size(0) <= MB;  // one cache block of rows
  return run_linear(x, I, 2, 1, [&]<int NP, int MT, typename T>(int64_t p, int64_t m0,
                                                                const QuantizedRows& q, T* y) {
    // groups of 2 pairs (one row) or 1: with_tile also instantiates NP = 4, never called
    if constexpr (NP <= 2) {
      const uint8_t* tiles[2 * NP];
      const uint8_t* next[2 * NP];  // the pairs after these
      for (int j = 0; j < NP; ++j) {
        tiles[2 * j] = w + (p + j) * tile_bytes;
        tiles[2 * j + 1] = w + (up + p + j) * tile_bytes;
        const bool more = p + NP + j < up;
        next[2 * j] = more ? w + (p + NP + j) * tile_bytes : nullptr;
        next[2 * j + 1] = more ? w + (up + p + NP + j) * tile_bytes : nullptr;
      }
      if (decode_sized && m0 == MAX_MT) prefetch_group(next, G);
      if (native)
        q4_tile<2 * NP, MT, true, T, true>(tiles, next, G, q.qx + m0 * K, q.dx + m0 * G,
                                           q.cx + m0 * G, K, y, I, I - p * TILE, l2);
      else
        q4_tile<2 * NP, MT, true, T>(tiles, next, G, q.qx + m0 * K, q.dx + m0 * G,
                                     q.cx + m0 * G, K, y, I, I - p * TILE, l2);
    }
  });
}

// x [M, K] float32/bfloat16, packed from pack_int8 of w [N, K], scale [N] float32 -> y [M, N]
// in x's dtype (y = x @ (w * scale[:, None]).T).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  const int64_t K = x.size(1), G = K / QK, tile_bytes = G * Q8_BLOCK, N = scale.numel();
  sgl_cpu::check_x(x, K, QK);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "scale must be a contiguous [N] float32 tensor");
  check_packed(packed, N, tile_bytes, "pack_int8");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const bool l2 = sgl_cpu::prefetch_into_l2();
  const int64_t units = (N + TILE - 1) / TILE;
  return run_linear(x, N, 4, 2, [&]<int NT, int MT, typename T>(int64_t t, int64_t m0,
                                                                 const QuantizedRows& q, T* y) {
    q8_tile<NT, MT, T>(w + t * tile_bytes, tile_bytes, G, q.qx + m0 * K, q.dx + m0 * G,
                       q.sx + m0 * G, K, sp + t * TILE, y, N, N - t * TILE,
                       units - (t + NT), l2);
  });
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY(sgl_cpu_vnni, m) {
  m.def("pack_int4(Tensor q, Tensor scale, Tensor zero) -> Tensor");
  m.def("pack_int8(Tensor w) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, int N) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale) -> Tensor");
  m.def("int4_linear_silu(Tensor x, Tensor packed, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) {
  m.impl("int4_linear", &sgl_cpu_vnni::int4_linear);
  m.impl("int8_linear", &sgl_cpu_vnni::int8_linear);
  m.impl("int4_linear_silu", &sgl_cpu_vnni::int4_linear_silu);
}
