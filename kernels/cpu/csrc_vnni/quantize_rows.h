// Activation quantization of the VNNI linear layers (vnni_linear.cpp): each row of x in blocks
// of QK = 32 to int8 (scale amax / 127, round to nearest even, clamped to [-127, 127]), with
// each block's scale, integer sum and their product, llama.cpp's Q8_1 (ggml-quants.c,
// quantize_row_q8_1). A row's values depend on that row only (batch invariance).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "packed_layout.h"
#include "vec512.h"

#include <cstdint>
#include <vector>

namespace sgl_cpu_vnni {
namespace {

// Quantized activations of M rows, in one scratch buffer of the calling thread (a decode step
// makes ~120 calls of a few KB each: no allocation per call): qx [M, K] int8, dx [M, G]
// scales, sx [M, G] block sums, cx [M, G] = dx * sx (the int4 offset term's factor).
struct QuantizedRows {
  const int8_t* qx;
  const float* dx;
  const int32_t* sx;
  const float* cx;
};

// The 16 blocks of one row at xb (512 inputs) into qb and the blocks' d_out, s_out, c_out: a
// lane per block for their amax and integer sums, each out of one reduce16 (where a horizontal
// max and sum per block were two latency chains; the values are the same: max and integer sums
// are exact in any order). All indices are compile-time, so the 16 vectors stay in registers.
template <typename T>
inline void quantize16(const T* xb, int8_t* qb, float* d_out, int32_t* s_out, float* c_out) {
  const auto max_op = [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); };
  const auto add_op = [](__m512 a, __m512 b) {  // int32 lanes
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  };
  __m512 v[16];
  for (int i = 0; i < 16; ++i)
    v[i] = _mm512_max_ps(_mm512_abs_ps(sgl_cpu::load16(xb + i * QK)),
                         _mm512_abs_ps(sgl_cpu::load16(xb + i * QK + 16)));
  const __m512 amax = sgl_cpu::in_slot_order(sgl_cpu::reduce16(v, max_op));
  const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
  const __m512 id = _mm512_maskz_div_ps(
      _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(127.0f), amax);
  // two blocks a step: their four int32 vectors narrowed to 64 bytes by the saturating packs
  // (exact: |x| * RN(127 / amax) <= 127 (1 + 2^-23) rounds to at most 127) and one permutation
  // back to input order, where a clamp and a narrowing store per 16 inputs took 3 operations
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int i = 0; i < 16; i += 2) {
    __m512i q[4];  // block i's two halves, then block i + 1's
    for (int h = 0; h < 4; ++h) {
      const int b = i + h / 2;
      const __m512 ib = _mm512_permutexvar_ps(_mm512_set1_epi32(b), id);
      q[h] = _mm512_cvtps_epi32(_mm512_mul_ps(sgl_cpu::load16(xb + b * QK + 16 * (h % 2)), ib));
    }
    v[i] = _mm512_castsi512_ps(_mm512_add_epi32(q[0], q[1]));
    v[i + 1] = _mm512_castsi512_ps(_mm512_add_epi32(q[2], q[3]));
    _mm512_storeu_si512(qb + i * QK, _mm512_permutexvar_epi32(
        order, _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]))));
  }
  const __m512i sum = _mm512_castps_si512(sgl_cpu::in_slot_order(sgl_cpu::reduce16(v, add_op)));
  _mm512_storeu_ps(d_out, d);
  _mm512_storeu_si512(s_out, sum);
  _mm512_storeu_ps(c_out, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
}

// One block of row x (a row's last K / 32 % 16 blocks): quantize16's values for it, by
// horizontal reductions (the same amax and sum: exact in any order; the same divisions and
// products, in scalar or in a lane).
template <typename T>
inline void quantize1(const T* xb, int8_t* qb, float* d_out, int32_t* s_out, float* c_out) {
  const __m512 lo = sgl_cpu::load16(xb), hi = sgl_cpu::load16(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float d = amax / 127.0f;
  const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));  // |q| <= 127
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  *d_out = d;
  *s_out = sum;
  *c_out = d * static_cast<float>(sum);
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t G = K / QK;
  thread_local std::vector<int64_t> scratch;  // int64: 8-byte alignment for every part
  const size_t bytes = M * K + 12 * M * G;
  // only ever grown: a resize that grows value-initializes, and shrinking for a 576-input
  // linear then growing for the 1,536-input one zeroed ~1 MB a layer on the calling thread
  // while the others waited (perf: memset 0.25% of a prefill's samples, all from here)
  const size_t words = (bytes + 7) / 8 + 1;
  if (scratch.size() < words) scratch.resize(words);
  int8_t* qp = reinterpret_cast<int8_t*>(scratch.data());
  float* dp = reinterpret_cast<float*>(qp + ((M * K + 7) / 8) * 8);
  int32_t* sp = reinterpret_cast<int32_t*>(dp + M * G);
  float* cp = reinterpret_cast<float*>(sp + M * G);
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    // locals, not the closure's references: the int8 stores may alias anything, so values
    // read through the closure were reloaded after each store
    const T* const xs = x;
    int8_t* const qs = qp;
    float* const ds = dp;
    int32_t* const ss = sp;
    float* const cs = cp;
    const int64_t KK = K, GG = G, full = G / 16 * 16;
    for (int64_t m = lo; m < hi; ++m) {
      int64_t g = 0;
      for (; g < full; g += 16)
        quantize16(xs + m * KK + g * QK, qs + m * KK + g * QK, ds + m * GG + g, ss + m * GG + g,
                   cs + m * GG + g);
      for (; g < GG; ++g)
        quantize1(xs + m * KK + g * QK, qs + m * KK + g * QK, ds + m * GG + g, ss + m * GG + g,
                  cs + m * GG + g);
    }
  });
  return {qp, dp, sp, cp};
}

}  // namespace
}  // namespace sgl_cpu_vnni
