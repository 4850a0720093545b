// The AVX2 chunk kernel of sgl_cpu::attention (attention_impl.h): one chunk of CHUNK positions of
// the online softmax: the scores of every (query token, head) unit of a tile, their running max /
// sum updates, and their P.V sums, over K/V rows that are read in place (float32 or bfloat16) or
// were staged as float32.
#pragma once

#include <immintrin.h>

#include "attention_common.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace sgl_cpu {
namespace {

// The 8 lane sums of a[0..7] as one vector (lane j = hsum(a[j])), in one fixed order.
inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves of rows 0-3), u1 likewise
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20), hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Scores of U (query token, head) units over one chunk: sc[u][j] = q[u] . k[j] (0 for missing
// rows). Each K row is converted once for the U units; every dot is one fixed chain (a multiply,
// then one FMA per 8 dims in order) reduced by reduce8, so a unit's scores are bitwise the same
// whatever units it is blocked with and whether its rows were staged as float32 or read in place.
template <int U, int NV, typename T>
inline void qk_block(const float* const* q, const ChunkRows<T>& rows, __m256 (*sc)[CHUNK / 8]) {
  alignas(32) float dots[U][8][8];
  for (int v = 0; v < CHUNK / 8; ++v) {
    for (int j = 0; j < 8; ++j) {
      const T* k = rows.k[8 * v + j];
      rows.prefetch(8 * v + j, 0);
      rows.prefetch(8 * v + j, 1);
      __m256 d[U];
      if (k == nullptr) {
        for (int u = 0; u < U; ++u) d[u] = _mm256_setzero_ps();
      } else {
        const __m256 k0 = load8(k);
        for (int u = 0; u < U; ++u) d[u] = _mm256_mul_ps(_mm256_loadu_ps(q[u]), k0);
        for (int t = 1; t < NV; ++t) {
          const __m256 kt = load8(k + 8 * t);
          for (int u = 0; u < U; ++u) d[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q[u] + 8 * t), kt, d[u]);
        }
      }
      for (int u = 0; u < U; ++u) _mm256_store_ps(dots[u][j], d[u]);
    }
    for (int u = 0; u < U; ++u) {
      __m256 dv[8];
      for (int j = 0; j < 8; ++j) dv[j] = _mm256_load_ps(dots[u][j]);
      sc[u][v] = reduce8(dv);
    }
  }
}

// acc[u][0 .. 8W) = acc * corr[u] + sum_j p[u][j] * v[j][0 .. 8W) over one chunk (missing rows
// skipped: their p is 0), for U units at once: the units share each V row, and their U x W
// accumulators are independent FMA chains, so the loop runs at the FMA units' throughput rather
// than one chain's latency. Each accumulator's arithmetic (the rescale, then one FMA per
// position in order) is the same whatever units it is blocked with.
template <int U, int W, typename T>
inline void pv_block(float* const* acc, const float* const* p, const float* corr,
                     const ChunkRows<T>& rows, int64_t d0) {
  __m256 a[U][W];
  for (int u = 0; u < U; ++u) {
    const __m256 c = _mm256_set1_ps(corr[u]);
    for (int w = 0; w < W; ++w) a[u][w] = _mm256_mul_ps(_mm256_loadu_ps(acc[u] + d0 + 8 * w), c);
  }
  for (int64_t j = 0; j < CHUNK; ++j) {
    const T* vrow = rows.v[j];
    if (vrow == nullptr) continue;
    __m256 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = load8(vrow + d0 + 8 * w);
    for (int u = 0; u < U; ++u) {
      const __m256 pj = _mm256_broadcast_ss(p[u] + j);
      for (int w = 0; w < W; ++w) a[u][w] = _mm256_fmadd_ps(pj, vv[w], a[u][w]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc[u] + d0 + 8 * w, a[u][w]);
}

template <int U, typename T>
inline void pv_units(float* const* acc, const float* const* p, const float* corr,
                     const ChunkRows<T>& rows, int64_t D) {
  // U x W accumulators + W V vectors + a broadcast within AVX2's 16 registers
  constexpr int W = U <= 2 ? 4 : 3;
  for (int64_t d0 = 0; d0 < D; d0 += 8 * W) {
    switch (std::min<int64_t>(W, (D - d0) / 8)) {
      case 4: if constexpr (W == 4) pv_block<U, 4>(acc, p, corr, rows, d0); break;
      case 3: pv_block<U, 3>(acc, p, corr, rows, d0); break;
      case 2: pv_block<U, 2>(acc, p, corr, rows, d0); break;
      default: pv_block<U, 1>(acc, p, corr, rows, d0); break;
    }
  }
}

// The AVX2 chunk kernel (attention_common.h states the contract): scores (qk_block, four units
// per K row conversion; a score is 8 lanes of one FMA chain each, summed by reduce8), each
// unit's running max / sum update and probabilities, then the P.V sums (pv_units, three units
// per V row conversion).
struct Avx2Chunk {
static constexpr bool kPrescaled = true, kStage = true, kBase2 = false;
template <int NV, typename T>
static void attend(const ChunkRows<T>& rows, int units, const float* const* q, float* const* out,
                   const float* const* valid, float /*scale: q is prescaled*/, float softcap,
                     float* prs) {
  constexpr int64_t D = 8 * NV;
  __m256 sc[4][CHUNK / 8];
  float* accs[TILE * MAX_GROUP];
  const float* ps[TILE * MAX_GROUP];
  float corrs[TILE * MAX_GROUP];
  for (int u0 = 0; u0 < units; u0 += 4) {
    const int n = std::min(4, units - u0);
    switch (n) {
      case 4: qk_block<4, NV>(q + u0, rows, sc); break;
      case 3: qk_block<3, NV>(q + u0, rows, sc); break;
      case 2: qk_block<2, NV>(q + u0, rows, sc); break;
      default: qk_block<1, NV>(q + u0, rows, sc); break;
    }
    for (int i = 0; i < n; ++i) {
      const int u = u0 + i;
      for (int v = 0; v < CHUNK / 8; ++v) {
        if (softcap > 0.0f) {
          alignas(32) float buf[8];
          _mm256_store_ps(buf, sc[i][v]);
          for (int j = 0; j < 8; ++j) buf[j] = softcap * std::tanh(buf[j] / softcap);
          sc[i][v] = _mm256_load_ps(buf);
        }
        if (valid[u] != nullptr)  // -inf: masked
          sc[i][v] = _mm256_add_ps(sc[i][v], _mm256_loadu_ps(valid[u] + 8 * v));
      }
      float* o = out[u];
      float* pr = prs + u * CHUNK;
      __m256 mv = sc[i][0];
      for (int v = 1; v < CHUNK / 8; ++v) mv = _mm256_max_ps(mv, sc[i][v]);
      const float mx = std::max(o[0], hmax(mv));
      const float corr = o[0] == NEG_INF ? 0.0f : exp1(o[0] - mx);
      const __m256 mxv = _mm256_set1_ps(mx);
      __m256 sum = _mm256_setzero_ps();
      for (int v = 0; v < CHUNK / 8; ++v) {
        const __m256 pv = exp256(_mm256_sub_ps(sc[i][v], mxv));  // 0 on masked lanes
        sum = _mm256_add_ps(sum, pv);
        _mm256_storeu_ps(pr + 8 * v, pv);
      }
      o[1] = o[1] * corr + hsum(sum);
      o[0] = mx;
      accs[u] = o + 2;
      ps[u] = pr;
      corrs[u] = corr;
    }
  }
  int u = 0;
  for (; u + 3 <= units; u += 3) pv_units<3>(accs + u, ps + u, corrs + u, rows, D);
  if (units - u == 2) pv_units<2>(accs + u, ps + u, corrs + u, rows, D);
  else if (units - u == 1) pv_units<1>(accs + u, ps + u, corrs + u, rows, D);
}
};

}  // namespace
}  // namespace sgl_cpu
