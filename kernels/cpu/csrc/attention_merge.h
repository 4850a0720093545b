// The last step of attention_impl.h's driver: each token's per-partition partials merged in
// partition order into its output (the log-sum-exp merge of flash-decoding, Dao et al. 2023),
// eight query heads of a token at a time: their running maxima, sums and rescales are the lanes
// of one vector, whose exponentials are lane for lane exp1's, so every head's output keeps the
// bits of merging it alone (sgl_cpu::exp256 on a lane is exp1 on that value; the build does
// not contract a multiply and an add, -ffp-contract=off). One exp256 per partition and head
// group instead of two exp1 calls per partition and head: the merge was 17-19% of a 4 x
// (1024 + 64) AMX call (perf, one thread).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include "attention_common.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace sgl_cpu {
namespace {

// partials: per (token, partition) [Hq][D + 2] floats (m, l, acc); part_off[t] .. part_off[t
// + 1]: token t's partitions; unit: ln 2 where m is in base 2, else 1. A head of a token with
// one partition holding any sum (l > 0, m finite) was written by its work item and is skipped.
// out [ntok][Hq][D] in T.
template <typename T>
void merge_partials(const float* partials, const int64_t* part_off, int64_t ntok, int64_t Hq,
                    int64_t D, float unit, T* out) {
  const int64_t pstride = Hq * (D + 2), groups = (Hq + 7) / 8;
  at::parallel_for(0, ntok * groups, 2, [&](int64_t lo_i, int64_t hi_i) {
    alignas(32) float acc[8 * MAX_D];
    alignas(32) float pm[8], pl[8], ca[8], cb[8], lv[8];
    for (int64_t w = lo_i; w < hi_i; ++w) {
      const int64_t tk = w / groups, h0 = (w % groups) * 8, nh = std::min<int64_t>(8, Hq - h0);
      const int64_t p0 = part_off[tk], p1 = part_off[tk + 1];
      bool write[8];
      bool any = false;
      for (int64_t h = 0; h < nh; ++h) {
        const float* first = partials + p0 * pstride + (h0 + h) * (D + 2);
        write[h] = !(p1 - p0 == 1 && first[1] > 0.0f && std::isfinite(first[0]));
        any |= write[h];
      }
      if (!any) continue;
      __m256 m = _mm256_set1_ps(NEG_INF), l = _mm256_setzero_ps();
      std::fill(acc, acc + nh * D, 0.0f);
      const __m256 neg_inf = _mm256_set1_ps(NEG_INF), vunit = _mm256_set1_ps(unit);
      for (int64_t pi = p0; pi < p1; ++pi) {
        const float* part = partials + pi * pstride + h0 * (D + 2);
        for (int64_t h = 0; h < 8; ++h) {  // lanes past the group: a part with no sum
          pm[h] = h < nh ? part[h * (D + 2)] : NEG_INF;
          pl[h] = h < nh ? part[h * (D + 2) + 1] : 0.0f;
        }
        const __m256 vm = _mm256_load_ps(pm), vl = _mm256_load_ps(pl);
        // lanes whose part holds no sum (l = 0) keep m, l and acc as they are
        const __m256 take = _mm256_cmp_ps(vl, _mm256_setzero_ps(), _CMP_NEQ_UQ);
        const __m256 mx = _mm256_max_ps(vm, m);  // std::max(m, part m): m unless m < part m
        const __m256 a = _mm256_blendv_ps(
            exp256(_mm256_mul_ps(_mm256_sub_ps(m, mx), vunit)), _mm256_setzero_ps(),
            _mm256_cmp_ps(m, neg_inf, _CMP_EQ_OQ));
        const __m256 b = exp256(_mm256_mul_ps(_mm256_sub_ps(vm, mx), vunit));
        l = _mm256_blendv_ps(l, _mm256_add_ps(_mm256_mul_ps(l, a), _mm256_mul_ps(vl, b)), take);
        m = _mm256_blendv_ps(m, mx, take);
        _mm256_store_ps(ca, a);
        _mm256_store_ps(cb, b);
        const int mask = _mm256_movemask_ps(take);
        for (int64_t h = 0; h < nh; ++h) {
          if (!((mask >> h) & 1)) continue;
          const __m256 va = _mm256_set1_ps(ca[h]), vb = _mm256_set1_ps(cb[h]);
          float* ah = acc + h * D;
          const float* ph = part + h * (D + 2) + 2;
          for (int64_t d = 0; d < D; d += 8)  // acc * ca + part * cb, rounded as written
            store8(ah + d, _mm256_add_ps(_mm256_mul_ps(load8(ah + d), va),
                                         _mm256_mul_ps(load8(ph + d), vb)));
        }
      }
      _mm256_store_ps(lv, l);
      for (int64_t h = 0; h < nh; ++h) {
        if (!write[h]) continue;
        const float inv = lv[h] > 0.0f ? 1.0f / lv[h] : 0.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        T* o = out + (tk * Hq + h0 + h) * D;
        for (int64_t d = 0; d < D; d += 8) store8(o + d, _mm256_mul_ps(load8(acc + h * D + d), vi));
      }
    }
  });
}

}  // namespace
}  // namespace sgl_cpu
