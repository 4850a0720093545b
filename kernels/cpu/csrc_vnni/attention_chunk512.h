// The AVX-512 chunk kernel of sgl_cpu_vnni::attention (the driver: ../csrc/attention_impl.h; the
// contract: ../csrc/attention_common.h): one chunk of CHUNK positions of the online softmax, the
// scores of every (query token, head) unit of a tile, their running max / sum updates and their
// P.V sums, 16 lanes a vector.
//
// A score q . k is 16 lane partials, lane i the FMA chain over dims i, i + 16, ... in order
// (a multiply, then one FMA per 16 dims), summed across lanes by one fixed tree (reduce16). The
// partials of 16 positions are reduced together, so a score costs D / 16 FMAs and about one
// shuffle-add rather than a horizontal sum of its own, and the tree is the same for every
// position, unit and chunk: a unit's scores are bitwise the same whatever units, tile or batch
// it is computed with, in a decode step or an extend pass. P.V sums are 16-lane FMA chains over
// positions in order, as the AVX2 kernel's.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include "../csrc/attention_common.h"
#include "vec512.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace sgl_cpu {
namespace {

#define SGL_INLINE inline __attribute__((always_inline))

static_assert(CHUNK == 32, "the kernel holds a chunk's scores in two vectors");

// reduce16's stages: each takes vectors a and b of partials and returns one vector holding,
// in half its lanes, a's partials summed pairwise, in the other half b's.
SGL_INLINE __m512 fold256(__m512 a, __m512 b) {  // lanes i, i + 8
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
SGL_INLINE __m512 fold128(__m512 a, __m512 b) {  // 128-bit blocks 0, 1 and 2, 3
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
SGL_INLINE __m512 fold64(__m512 a, __m512 b) {  // lanes 0, 2 and 1, 3 of each block
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
SGL_INLINE __m512 fold32(__m512 a, __m512 b) {  // lanes 0, 1 and 2, 3 of each block
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// The score partials of 16 positions are reduced by reduce16's tree (vec512.h), inline below:
// putting position p in slot SLOT_OF[p] gives the scores in order.

// The lane partials d[u] of q[u] . k for the U units (zero when k is missing).
template <int U, int NV16, typename T>
SGL_INLINE void partials(const __m512 (*qv)[NV16], const T* k, __mmask16 tail, __m512* d) {
  if (k == nullptr) {
    for (int u = 0; u < U; ++u) d[u] = _mm512_setzero_ps();
    return;
  }
  const __m512 k0 = NV16 > 1 ? load16(k, 0xFFFF) : load16(k, tail);
  for (int u = 0; u < U; ++u) d[u] = _mm512_mul_ps(qv[u][0], k0);
  for (int t = 1; t < NV16; ++t) {
    const __m512 kt = load16(k + 16 * t, t + 1 < NV16 ? __mmask16(0xFFFF) : tail);
    for (int u = 0; u < U; ++u) d[u] = _mm512_fmadd_ps(qv[u][t], kt, d[u]);
  }
}

// fold128(fold256(slots s, s + 8), fold256(slots s + 4, s + 12)) of positions base + SLOT_OF[.]
template <int U, int NV16, typename T>
SGL_INLINE void quarter(const __m512 (*qv)[NV16], const ChunkRows<T>& rows, int base, int s,
                        __mmask16 tail, __m512* out) {
  __m512 a[U], b[U], z[U];
  for (int i = 0; i < 2; ++i) {
    const int s0 = s + 4 * i;
    for (int j : {base + SLOT_OF[s0], base + SLOT_OF[s0 + 8]}) {
      rows.prefetch(j, 0);
      rows.prefetch(j, 1);
    }
    partials<U, NV16>(qv, rows.k[base + SLOT_OF[s0]], tail, a);
    partials<U, NV16>(qv, rows.k[base + SLOT_OF[s0 + 8]], tail, b);
    for (int u = 0; u < U; ++u) {
      const __m512 f = fold256(a[u], b[u]);
      if (i == 0) z[u] = f;
      else out[u] = fold128(z[u], f);
    }
  }
}

// Scores of U (query token, head) units over one chunk: sc[u][h] lane i = q[u] . k[16 h + i]
// (0 for missing rows). Each K row is loaded (converted) once for the U units.
template <int U, int NV16, typename T>
SGL_INLINE void qk_block(const float* const* q, const ChunkRows<T>& rows, __mmask16 tail,
                         __m512 (*sc)[CHUNK / 16]) {
  __m512 qv[U][NV16];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NV16; ++t)
      qv[u][t] = load16(q[u] + 16 * t, t + 1 < NV16 ? __mmask16(0xFFFF) : tail);
  for (int h = 0; h < CHUNK / 16; ++h) {
    __m512 a[U], b[U], u0[U];
    quarter<U, NV16>(qv, rows, 16 * h, 0, tail, a);
    quarter<U, NV16>(qv, rows, 16 * h, 2, tail, b);
    for (int u = 0; u < U; ++u) u0[u] = fold64(a[u], b[u]);
    quarter<U, NV16>(qv, rows, 16 * h, 1, tail, a);
    quarter<U, NV16>(qv, rows, 16 * h, 3, tail, b);
    for (int u = 0; u < U; ++u) sc[u][h] = fold32(u0[u], fold64(a[u], b[u]));
  }
}

// acc[u][d0 .. d0 + 64) = acc * corr[u] + sum_j p[u][j] * v[j][d0 ..] over one chunk (missing
// rows skipped: their p is 0) for U units sharing each V row; lanes past D are masked. Each
// accumulator lane's arithmetic (the rescale, then one FMA per position in order) does not
// depend on the units it is blocked with.
template <int U, bool FULL, typename T>
SGL_INLINE void pv_block(float* const* acc, const float* const* p, const float* corr,
                         const ChunkRows<T>& rows, int64_t d0, int64_t D) {
  constexpr int W = 4;
  __mmask16 m[W];
  for (int w = 0; w < W; ++w) m[w] = FULL ? __mmask16(0xFFFF) : lanes(D - d0 - 16 * w);
  __m512 a[U][W];
  for (int u = 0; u < U; ++u) {
    const __m512 c = _mm512_set1_ps(corr[u]);
    for (int w = 0; w < W; ++w) a[u][w] = _mm512_mul_ps(load16(acc[u] + d0 + 16 * w, m[w]), c);
  }
  for (int64_t j = 0; j < CHUNK; ++j) {
    const T* vrow = rows.v[j];
    if (vrow == nullptr) continue;
    __m512 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = load16(vrow + d0 + 16 * w, m[w]);
    for (int u = 0; u < U; ++u) {
      const __m512 pj = _mm512_set1_ps(p[u][j]);
      for (int w = 0; w < W; ++w) a[u][w] = _mm512_fmadd_ps(pj, vv[w], a[u][w]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int w = 0; w < W; ++w) store16(acc[u] + d0 + 16 * w, a[u][w], m[w]);
}

template <int U, typename T>
void pv_units(float* const* acc, const float* const* p, const float* corr,
              const ChunkRows<T>& rows, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    if (d0 + 64 <= D) pv_block<U, true>(acc, p, corr, rows, d0, D);
    else pv_block<U, false>(acc, p, corr, rows, d0, D);
  }
}

constexpr float LOG2E = 1.44269504088896341f;

// Scores in base 2 (BASE2: a chunk kernel whose scores are scaled by log2(e), so its softmax
// runs on exp2_512, its m in base 2) or in base e (exp512).
template <bool BASE2>
SGL_INLINE __m512 exp_scores(__m512 x) {
  if constexpr (BASE2) return exp2_512(x);
  else return exp512(x);
}

// One unit's chunk of scores: soft-capping (softcap * tanh(s / softcap), when softcap > 0, on
// scores in base e: with BASE2 they come unscaled by log2(e) and are scaled after it), then
// the mask (valid: 0 / -inf per position, nullptr for none).
template <bool BASE2>
SGL_INLINE void cap_and_mask(__m512* sc, float softcap, const float* valid) {
  for (int h = 0; h < CHUNK / 16; ++h) {
    if (softcap > 0.0f) {
      alignas(64) float buf[16];
      _mm512_store_ps(buf, sc[h]);
      for (int j = 0; j < 16; ++j) buf[j] = softcap * std::tanh(buf[j] / softcap);
      sc[h] = _mm512_load_ps(buf);
      if constexpr (BASE2) sc[h] = _mm512_mul_ps(sc[h], _mm512_set1_ps(LOG2E));
    }
    if (valid != nullptr)  // -inf: masked
      sc[h] = _mm512_add_ps(sc[h], _mm512_loadu_ps(valid + 16 * h));
  }
}

// A unit's chunk of probabilities p0 (positions 0-15), p1 (16-31) into pr: 32 float32, or
// with BF16P 32 bfloat16 (bf16_native: only where the CPU has AVX512-BF16).
template <bool BF16P>
SGL_INLINE void store_p(float* pr, __m512 p0, __m512 p1) {
  if constexpr (BF16P) {
    __m256i* pb = reinterpret_cast<__m256i*>(pr);
    _mm256_storeu_si256(pb, bf16_native(p0));
    _mm256_storeu_si256(pb + 1, bf16_native(p1));
  } else {
    _mm512_storeu_ps(pr, p0);
    _mm512_storeu_ps(pr + 16, p1);
  }
}

// The online-softmax step of units u0 .. u0 + n - 1 (n <= 16) over one chunk, from their
// scores sc[i] (positions 0-15, 16-31; scaled): soft-capping, the mask, the new running max m
// and sum l in out[u], the probabilities exp(s - m) into prs + u * CHUNK (float32) and the
// rescale of the old sums, exp(m_old - m_new), into corrs[u] (0 where nothing was accumulated
// yet). The rescales of the n units are one vector exp; every lane is computed alike. BF16P:
// the probabilities are stored as bfloat16 (store_p).
template <bool BASE2, bool BF16P = false>
SGL_INLINE void softmax_step(__m512 (*sc)[CHUNK / 16], int n, int u0, float* const* out,
                             const float* const* valid, float softcap, float* prs,
                             float* corrs) {
  alignas(64) float delta[16] = {};
  float mxs[16];
  for (int i = 0; i < n; ++i) {
    const int u = u0 + i;
    cap_and_mask<BASE2>(sc[i], softcap, valid[u]);
    const float m = out[u][0];
    mxs[i] = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(sc[i][0], sc[i][1])));
    delta[i] = m == NEG_INF ? NEG_INF : m - mxs[i];
  }
  _mm512_store_ps(delta, exp_scores<BASE2>(_mm512_load_ps(delta)));  // exp(-inf) = 0
  for (int i = 0; i < n; ++i) {
    const int u = u0 + i;
    float* o = out[u];
    const __m512 mxv = _mm512_set1_ps(mxs[i]);
    const __m512 p0 = exp_scores<BASE2>(_mm512_sub_ps(sc[i][0], mxv));  // 0 on masked lanes
    const __m512 p1 = exp_scores<BASE2>(_mm512_sub_ps(sc[i][1], mxv));
    store_p<BF16P>(prs + u * CHUNK, p0, p1);
    o[1] = o[1] * delta[i] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    o[0] = mxs[i];
    corrs[u] = delta[i];
  }
}

// softmax_step of n <= 16 units at once, a lane per unit for their maxima, sums and rescales:
// the 16 units' max(s0, s1) and p0 + p1 vectors go through reduce16's tree (vec512.h; with
// max, then with add), whose order is _mm512_reduce_add_ps's, so every unit's m, l, p and
// rescale are bitwise softmax_step's, without its two horizontal reductions and scalar
// updates per unit. Lane SLOT_OF[i] holds unit i. BF16P as softmax_step's.
template <bool BASE2, bool BF16P = false>
SGL_INLINE void softmax_step16(__m512 (*sc)[CHUNK / 16], int n, int u0, float* const* out,
                               const float* const* valid, float softcap, float* prs,
                               float* corrs) {
  const __m512 neg_inf = _mm512_set1_ps(NEG_INF);
  alignas(64) float m_old[16], l_old[16], m_new[16], l_new[16], corr[16];
  __m512 s[16];
  for (int i = 0; i < 16; ++i) {
    const int slot = SLOT_OF[i];  // unit i's lane
    if (i >= n) {
      s[i] = neg_inf;
      m_old[slot] = NEG_INF;
      l_old[slot] = 0.0f;
      continue;
    }
    const int u = u0 + i;
    cap_and_mask<BASE2>(sc[i], softcap, valid[u]);
    s[i] = _mm512_max_ps(sc[i][0], sc[i][1]);
    m_old[slot] = out[u][0];
    l_old[slot] = out[u][1];
  }
  const __m512 mo = _mm512_load_ps(m_old);
  // std::max(m, x) is x where m < x, else m: vmaxps(x, m) (the second operand on ties)
  const __m512 mn = _mm512_max_ps(reduce16(s, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }), mo);
  const __mmask16 fresh = _mm512_cmp_ps_mask(mo, neg_inf, _CMP_EQ_OQ);
  // exp(-inf) = 0 where nothing was accumulated yet
  const __m512 cv = exp_scores<BASE2>(_mm512_mask_blend_ps(fresh, _mm512_sub_ps(mo, mn), neg_inf));
  _mm512_store_ps(m_new, mn);
  _mm512_store_ps(corr, cv);
  for (int i = 0; i < 16; ++i) {
    if (i >= n) {
      s[i] = _mm512_setzero_ps();
      continue;
    }
    const int u = u0 + i;
    const __m512 mxv = _mm512_set1_ps(m_new[SLOT_OF[i]]);
    const __m512 p0 = exp_scores<BASE2>(_mm512_sub_ps(sc[i][0], mxv));  // 0 on masked lanes
    const __m512 p1 = exp_scores<BASE2>(_mm512_sub_ps(sc[i][1], mxv));
    store_p<BF16P>(prs + u * CHUNK, p0, p1);
    s[i] = _mm512_add_ps(p0, p1);
  }
  // l * rescale + sum, one rounding (softmax_step's scalar expression is contracted to an FMA)
  _mm512_store_ps(l_new, _mm512_fmadd_ps(_mm512_load_ps(l_old), cv,
                                         reduce16(s, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); })));
  for (int i = 0; i < n; ++i) {
    const int u = u0 + i, slot = SLOT_OF[i];
    out[u][0] = m_new[slot];
    out[u][1] = l_new[slot];
    corrs[u] = corr[slot];
  }
}

struct Avx512Chunk {
  static constexpr bool kPrescaled = true, kStage = true, kBase2 = false;
  template <int NV, typename T>
  static void attend(const ChunkRows<T>& rows, int units, const float* const* q,
                     float* const* out, const float* const* valid, float /*scale*/,
                     float softcap, float* prs) {
    constexpr int64_t D = 8 * NV;
    constexpr int NV16 = (NV + 1) / 2;
    const __mmask16 tail = NV % 2 ? __mmask16(0x00FF) : __mmask16(0xFFFF);
    constexpr int QU = NV16 <= 4 ? 4 : 2;  // units per K row load: q of QU units in registers
    __m512 sc[QU][CHUNK / 16];
    float* accs[TILE * MAX_GROUP];
    const float* ps[TILE * MAX_GROUP];
    float corrs[TILE * MAX_GROUP];
    for (int u0 = 0; u0 < units; u0 += QU) {
      const int n = std::min(QU, units - u0);
      switch (n) {
        case 4: if constexpr (QU == 4) qk_block<4, NV16>(q + u0, rows, tail, sc); break;
        case 3: if constexpr (QU == 4) qk_block<3, NV16>(q + u0, rows, tail, sc); break;
        case 2: qk_block<2, NV16>(q + u0, rows, tail, sc); break;
        default: qk_block<1, NV16>(q + u0, rows, tail, sc); break;
      }
      softmax_step<false>(sc, n, u0, out, valid, softcap, prs, corrs);
    }
    for (int u = 0; u < units; ++u) {
      accs[u] = out[u] + 2;
      ps[u] = prs + u * CHUNK;
    }
    int u = 0;
    for (; u + 4 <= units; u += 4) pv_units<4>(accs + u, ps + u, corrs + u, rows, D);
    switch (units - u) {
      case 3: pv_units<3>(accs + u, ps + u, corrs + u, rows, D); break;
      case 2: pv_units<2>(accs + u, ps + u, corrs + u, rows, D); break;
      case 1: pv_units<1>(accs + u, ps + u, corrs + u, rows, D); break;
    }
  }
};

#undef SGL_INLINE

}  // namespace
}  // namespace sgl_cpu
