// sgl_cpu_vnni::attention_bf16: the attention driver (../csrc/attention_impl.h) on a chunk kernel
// whose dot products run on AVX512-BF16 (vdpbf16ps: 32 bf16 products a vector, in pairs, into
// 16 float32 lanes), for bfloat16 queries over a bfloat16 KV pool with head_dim a multiple of
// 32; other inputs run the float32 AVX-512 kernel (attention512.cpp). Compiled for AVX512-BF16
// (this file's functions only), called only where the CPU has it (kernels/cpu/__init__.py).
//
// Per chunk of 32 positions, the K rows are transposed once into pair columns kt[c] (position
// p's lane holds k[p][2c], k[p][2c + 1]), so a unit's 32 scores are two vectors of dot
// products chained over c in order, with no horizontal sums; V rows are interleaved in
// position pairs vp[i] (lane d holds v[2i][d], v[2i + 1][d]), so P.V is a chain over pairs in
// order, p rounded to bfloat16 as flash-attention kernels do (Dao 2023, FlashAttention-2 sec.
// 3.1: P in the matmul dtype, the running sum l in float32). The softmax runs in base 2, as
// FlashAttention-2's kernels do (exp2 with log2(e) folded into the softmax scale): scores are
// scaled by scale * log2(e) (by log2(e) after soft-capping, where there is one), m is in base
// 2 and each exponential is exp2_512's 9 operations instead of exp512's 15; the
// probabilities are stored as bf16 straight from the softmax. A chunk of a decode step (up to
// 4 units: one token's group of heads) would read kt and vp in one pass each, so it takes each
// transposed K block and interleaved V pair from the rows into registers instead of storing
// them (on a Zen 4, 1 x (4096 + 1) from L1 0.079 -> 0.068 ms, 13%). A score or output lane's
// arithmetic is the same whatever units, tile or batch it is computed with, decode or extend.
#include <torch/library.h>

#include "../csrc/attention_impl.h"
#include "attention_chunk512.h"
#include "attention_entry.h"
#include "attention_pairs.h"


#pragma GCC push_options
#pragma GCC target("avx512bf16")

#define SGL_INLINE inline __attribute__((always_inline))

namespace sgl_cpu {
namespace {

// Scores of U units: sc[u][h] lane i = scale * sum_c dp(q[u] pair c, k[16 h + i] pair c), the
// chain over c in order starting from 0. qw[u]: [D / 2] pairs.
template <int U, int64_t D>
SGL_INLINE void qk_bf16(const uint32_t* const* qw, const uint32_t* kt, float scale,
                        __m512 (*sc)[CHUNK / 16]) {
  __m512 acc[U][2];
  for (int u = 0; u < U; ++u) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D / 2; ++c) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + c * CHUNK);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + c * CHUNK + 16);
    for (int u = 0; u < U; ++u) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[u][c]));
      acc[u][0] = _mm512_dpbf16_ps(acc[u][0], qb, k0);
      acc[u][1] = _mm512_dpbf16_ps(acc[u][1], qb, k1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int u = 0; u < U; ++u) {
    sc[u][0] = _mm512_mul_ps(acc[u][0], s);
    sc[u][1] = _mm512_mul_ps(acc[u][1], s);
  }
}

// qk_bf16's scores straight from the K rows, for a chunk whose kt would serve a single pass:
// each 16-row x 16-pair block is transposed in registers and consumed at once. A lane's chain
// over c runs in the same order over the same operands, so these are qk_bf16's bits without
// kt's stores and reloads (128 vector stores and loads a chunk with D = 64).
template <int U, int64_t D>
SGL_INLINE void qk_rows_bf16(const uint32_t* const* qw, const ChunkRows<c10::BFloat16>& rows,
                             float scale, __m512 (*sc)[CHUNK / 16]) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int h = 0; h < CHUNK / 16; ++h) {
    for (int j = 16 * h; j < 16 * h + 16; ++j) rows.prefetch(j, 0);
    __m512 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < D / 2; c0 += 16) {
      __m512i r[16];
      k_block(rows, h, c0, r);
      for (int c = 0; c < 16; ++c)
        for (int u = 0; u < U; ++u) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[u][c0 + c]));
          acc[u] = _mm512_dpbf16_ps(acc[u], qb, (__m512bh)r[c]);
        }
    }
    for (int u = 0; u < U; ++u) sc[u][h] = _mm512_mul_ps(acc[u], s);
  }
}

constexpr int PV_W = 4;  // output vectors (16 dims each) a pass of pv_bf16 holds per unit

// acc[u][0 .. D) = acc * corr[u] + sum_i dp(p[u] pair i, vp[i]) over the chunk's 16 position
// pairs in order; pw[u]: [CHUNK / 2] pairs of bf16 probabilities. v_at(i, d0, nw, vv) gives
// vp[i][d0 .. d0 + 16 nw) as nw vectors (from interleave_v's vp, or v_pairs from the rows:
// the same words, so the same bits).
template <int U, int64_t D, typename VAt>
SGL_INLINE void pv_bf16(float* const* acc, const uint32_t* const* pw, const float* corr,
                        VAt&& v_at) {
  constexpr int W = PV_W;
  for (int64_t d0 = 0; d0 < D; d0 += 16 * W) {
    const int nw = static_cast<int>(std::min<int64_t>(W, (D - d0) / 16));
    __m512 a[U][W];
    for (int u = 0; u < U; ++u) {
      const __m512 c = _mm512_set1_ps(corr[u]);
      for (int w = 0; w < W; ++w)
        if (w < nw) a[u][w] = _mm512_mul_ps(_mm512_loadu_ps(acc[u] + d0 + 16 * w), c);
    }
    for (int i = 0; i < CHUNK / 2; ++i) {
      __m512i vv[W];
      v_at(i, d0, nw, vv);
      for (int u = 0; u < U; ++u) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[u][i]));
        for (int w = 0; w < W; ++w)
          if (w < nw) a[u][w] = _mm512_dpbf16_ps(a[u][w], pb, (__m512bh)vv[w]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int w = 0; w < W; ++w)
        if (w < nw) _mm512_storeu_ps(acc[u] + d0 + 16 * w, a[u][w]);
  }
}

struct Bf16Chunk {
  static constexpr bool kPrescaled = false, kStage = false, kBase2 = true;
  template <int NV, typename T>
  static void attend(const ChunkRows<T>& rows, int units, const float* const* q,
                     float* const* out, const float* const* valid, float scale, float softcap,
                     float* prs) {
    if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 4 == 0) {
      constexpr int64_t D = 8 * NV;
      constexpr int QU = 6;  // units per pass over kt: 12 independent chains
      // from this many units a chunk's softmax runs 16 units at a time (softmax_step16): below
      // it (a decode step's group of heads) the padded lanes would cost more than they save
      constexpr int SOFTMAX16_UNITS = 8;
      // Up to this many units (a decode step's group of heads of one token) kt and vp would
      // each be read by one pass: their blocks go from the rows to registers instead
      // (qk_rows_bf16, v_pairs; the same words in the same order, so the same bits)
      constexpr int DIRECT_UNITS = 4;
      const bool direct = units <= DIRECT_UNITS;
      alignas(64) uint32_t kt[D / 2 * CHUNK];
      alignas(64) uint32_t vp[CHUNK / 2 * D];
      const uint32_t* qw[TILE * MAX_GROUP];
      const uint32_t* pw[TILE * MAX_GROUP];
      float* accs[TILE * MAX_GROUP];
      float corrs[TILE * MAX_GROUP];
      // scores in base 2 (kBase2): log2(e) folded into the scale, or applied after capping
      const float qk_scale = softcap > 0.0f ? scale : scale * LOG2E;
      if (!direct) {
        transpose_k<D>(rows, kt);
        interleave_v<D>(rows, vp);
      }
      for (int u = 0; u < units; ++u)  // the driver passes q as it came: bfloat16 pairs
        qw[u] = reinterpret_cast<const uint32_t*>(q[u]);
      auto scores = [&](int u0, int n, __m512 (*sc)[CHUNK / 16]) {  // n <= QU units
        if (direct) {
          switch (n) {
            case 4: qk_rows_bf16<4, D>(qw + u0, rows, qk_scale, sc); break;
            case 3: qk_rows_bf16<3, D>(qw + u0, rows, qk_scale, sc); break;
            case 2: qk_rows_bf16<2, D>(qw + u0, rows, qk_scale, sc); break;
            default: qk_rows_bf16<1, D>(qw + u0, rows, qk_scale, sc); break;
          }
          return;
        }
        switch (n) {
          case 6: qk_bf16<6, D>(qw + u0, kt, qk_scale, sc); break;
          case 5: qk_bf16<5, D>(qw + u0, kt, qk_scale, sc); break;
          case 4: qk_bf16<4, D>(qw + u0, kt, qk_scale, sc); break;
          case 3: qk_bf16<3, D>(qw + u0, kt, qk_scale, sc); break;
          case 2: qk_bf16<2, D>(qw + u0, kt, qk_scale, sc); break;
          default: qk_bf16<1, D>(qw + u0, kt, qk_scale, sc); break;
        }
      };
      if (units < SOFTMAX16_UNITS) {
        __m512 sc[QU][CHUNK / 16];
        for (int u0 = 0; u0 < units; u0 += QU) {
          const int n = std::min(QU, units - u0);
          scores(u0, n, sc);
          softmax_step<true, true>(sc, n, u0, out, valid, softcap, prs, corrs);  // p in bf16
        }
      } else {  // the same bits, the softmax of 16 units at a time
        __m512 sc[16][CHUNK / 16];
        for (int u0 = 0; u0 < units; u0 += 16) {
          const int n = std::min(16, units - u0);
          for (int v0 = 0; v0 < n; v0 += QU) scores(u0 + v0, std::min(QU, n - v0), sc + v0);
          softmax_step16<true, true>(sc, n, u0, out, valid, softcap, prs, corrs);  // p in bf16
        }
      }
      for (int u = 0; u < units; ++u) {  // p as bf16 pairs
        pw[u] = reinterpret_cast<const uint32_t*>(prs + u * CHUNK);
        accs[u] = out[u] + 2;
      }
      auto pv = [&](auto v_at) {
        int u = 0;
        for (; u + 4 <= units; u += 4) pv_bf16<4, D>(accs + u, pw + u, corrs + u, v_at);
        switch (units - u) {
          case 3: pv_bf16<3, D>(accs + u, pw + u, corrs + u, v_at); break;
          case 2: pv_bf16<2, D>(accs + u, pw + u, corrs + u, v_at); break;
          case 1: pv_bf16<1, D>(accs + u, pw + u, corrs + u, v_at); break;
        }
      };
      if (direct) {
        __m512i lo, hi;
        v_pair_index(&lo, &hi);
        pv([&](int i, int64_t d0, int nw, __m512i* vv) {
          if (d0 == 0) {
            rows.prefetch(2 * i, 1);
            rows.prefetch(2 * i + 1, 1);
          }
          v_pairs(rows, i, d0, nw, lo, hi, vv);
        });
      } else {
        // A constant bound and a guard, not `w < nw`: with the runtime bound GCC turned these
        // loads into a block copy through the stack (store and reload per position pair),
        // and P.V took a third longer than the scores' equal count of vdpbf16ps (Zen 4, 11-29)
        pv([&](int i, int64_t d0, int nw, __m512i* vv) {
          for (int w = 0; w < PV_W; ++w)
            if (w < nw) vv[w] = _mm512_load_si512(vp + i * D + d0 + 16 * w);
        });
      }
    } else {
      TORCH_CHECK(false, "attention_bf16 runs bfloat16 K/V with head_dim a multiple of 32");
    }
  }
};

}  // namespace
}  // namespace sgl_cpu

#undef SGL_INLINE
#pragma GCC pop_options

namespace sgl_cpu_vnni {

// As sgl_cpu::attention, on the bf16 dot-product kernel (attention_entry.h).
at::Tensor attention_bf16(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                          const at::Tensor& req_to_token, const at::Tensor& req_rows,
                          const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                          double scale, int64_t window, double softcap) {
  return attention_on_bf16_chunk<sgl_cpu::Bf16Chunk>(q, k_buf, v_buf, req_to_token, req_rows,
                                                     prefix_lens, extend_lens, scale, window,
                                                     softcap);
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY_FRAGMENT(sgl_cpu_vnni, m) { m.def(SGL_ATTENTION_SCHEMA("attention_bf16")); }

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) {
  m.impl("attention_bf16", &sgl_cpu_vnni::attention_bf16);
}
