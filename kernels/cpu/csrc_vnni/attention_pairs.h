// The bf16 chunk kernels' K and V layouts (attention_bf16.cpp, attention_amx.cpp): a chunk's
// K rows transposed into pair columns kt [D / 2][CHUNK] (pair c of position p: k[p][2c],
// k[p][2c + 1]) and its V rows interleaved in position pairs vp [CHUNK / 2][D] (v[2i][d],
// v[2i + 1][d]) -- the B operands of vdpbf16ps and of AMX's TDPBF16PS alike. Plain AVX-512
// F/BW shuffles.
#pragma once

#include <immintrin.h>

#include "attention_chunk512.h"

namespace sgl_cpu {
namespace {

#define SGL_PAIRS_INLINE inline __attribute__((always_inline))

// r[i] = 16 32-bit lanes of row i -> r[c] lane i = row i's lane c
SGL_PAIRS_INLINE void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
  }
}

// The pairs (v[2i][d], v[2i + 1][d]) for d in [d0, d0 + 16 nw) (nw even), as interleave_v
// lays them out: vv[w] lane l = d0 + 16 w + l (0 where a row is missing).
SGL_PAIRS_INLINE void v_pairs(const ChunkRows<c10::BFloat16>& rows, int i, int64_t d0, int nw,
                        __m512i lo, __m512i hi, __m512i* vv) {
  const c10::BFloat16* a = rows.v[2 * i];
  const c10::BFloat16* b = rows.v[2 * i + 1];
  for (int w = 0; w < nw; w += 2) {
    const int64_t d = d0 + 16 * w;
    const __m512i x = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
    const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
    vv[w] = _mm512_permutex2var_epi16(x, lo, y);
    vv[w + 1] = _mm512_permutex2var_epi16(x, hi, y);
  }
}

// vpermt2w's index vectors for v_pairs: lo pairs lanes 0-15 of two rows, hi lanes 16-31
SGL_PAIRS_INLINE void v_pair_index(__m512i* lo, __m512i* hi) {
  alignas(64) static constexpr uint16_t LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  *lo = _mm512_load_si512(LO);
  *hi = _mm512_add_epi16(*lo, _mm512_set1_epi16(16));
}

// vp[i][d] = the 32-bit pair (v[2i][d], v[2i + 1][d]) (0 where a row is missing); vp:
// [CHUNK / 2][D] 32-bit words.
template <int64_t D>
SGL_PAIRS_INLINE void interleave_v(const ChunkRows<c10::BFloat16>& rows, uint32_t* vp) {
  __m512i lo, hi;
  v_pair_index(&lo, &hi);
  for (int i = 0; i < CHUNK / 2; ++i) {
    rows.prefetch(2 * i, 1);
    rows.prefetch(2 * i + 1, 1);
    __m512i vv[D / 16];
    v_pairs(rows, i, 0, D / 16, lo, hi, vv);
    for (int w = 0; w < D / 16; ++w) _mm512_store_si512(vp + i * D + 16 * w, vv[w]);
  }
}

// K rows r[i] = rows.k[16 h + i] pairs c0 .. c0 + 15 (0 where a row is missing), transposed:
// r[c] lane i = row 16 h + i's pair c0 + c.
SGL_PAIRS_INLINE void k_block(const ChunkRows<c10::BFloat16>& rows, int h, int64_t c0, __m512i* r) {
  for (int i = 0; i < 16; ++i) {
    const c10::BFloat16* k = rows.k[16 * h + i];
    r[i] = k ? _mm512_loadu_si512(k + 2 * c0) : _mm512_setzero_si512();
  }
  transpose16(r);
}

// kt[c][p] = the 32-bit pair (k[p][2c], k[p][2c + 1]) for the chunk's 32 positions (0 where a
// row is missing); kt: [D / 2][CHUNK] 32-bit words.
template <int64_t D>
SGL_PAIRS_INLINE void transpose_k(const ChunkRows<c10::BFloat16>& rows, uint32_t* kt) {
  for (int h = 0; h < CHUNK / 16; ++h) {
    for (int j = 16 * h; j < 16 * h + 16; ++j) rows.prefetch(j, 0);
    for (int64_t c0 = 0; c0 < D / 2; c0 += 16) {
      __m512i r[16];
      k_block(rows, h, c0, r);
      for (int c = 0; c < 16; ++c) _mm512_store_si512(kt + (c0 + c) * CHUNK + 16 * h, r[c]);
    }
  }
}

}  // namespace
}  // namespace sgl_cpu

#undef SGL_PAIRS_INLINE
