// sgl_cpu_vnni::attention_amx: the attention driver (../csrc/attention_impl.h) on a chunk
// kernel whose two products run on AMX bf16 tiles (TDPBF16PS: 16 rows x 16 columns x 32 bf16
// products an instruction, float32 accumulation), for bfloat16 queries over a bfloat16 KV
// pool with head_dim a multiple of 32; other inputs run the float32 AVX-512 kernel
// (attention512.cpp). On Sapphire Rapids vdpbf16ps (attention_bf16.cpp's kernel) issues one a
// cycle at best, half the float32 FMA rate (74 GFLOP/s a core measured, 2026-11-29), where a
// tile instruction does 16,384 FLOP in ~16 cycles.
//
// Per chunk of 32 positions the K rows are transposed into pair columns and the V rows
// interleaved in position pairs (attention_pairs.h: the B layouts TDPBF16PS reads). Head_dim
// 32 and 64 (attend_span): each work item lays out all its chunks, then runs each block of up
// to 16 units (a unit: one query token x head) over them with its P.V accumulators held in
// tiles and a running max that moves only by more than 2^8 (so the accumulators rarely leave
// the tiles). Wider heads (attend): per chunk, for each block, S = q . k^T into two 16 x 16
// float32 tiles (positions 0-15, 16-31) summed over the head dim 32 at a time in order, times
// scale; the online-softmax step of attention_chunk512.h (softmax_step16, base 2 as
// attention_bf16.cpp's kernel, p rounded to bf16); then acc = acc * rescale + P.V, the
// rescaled accumulators loaded into tiles and the 16 position pairs of the chunk added by one
// instruction per 16 dims. Every chunk of every pass, decode or extend, runs the same code for
// a head_dim, so a token's output is bitwise the same in any pass; its bits differ from the
// other kernels' (the order of the sums within an instruction is the hardware's).
//
// attend_span replaced attend at head_dim 64 (SmolLM2's, Llama-3.2-1B's): SmolLM2's heads, one
// thread, min of 40 calls, six alternated pairs of processes, Xeon with AMX (2026-11-29):
// extends 4 x (1024 + 64) 3.65 -> 2.44 ms, 1 x (0 + 512) 1.64 -> 1.07, 4 x (650 + 3) 0.218
// -> 0.155; decodes 16 x (512 + 1) 0.575 -> 0.517, 1 x (4096 + 1) 0.250 -> 0.218.
#include <torch/library.h>

#include "../csrc/attention_impl.h"
#include "amx_tiles.h"
#include "attention_chunk512.h"
#include "attention_entry.h"
#include "attention_pairs.h"

#include <memory>

#pragma GCC push_options
#pragma GCC target("avx512bf16,amx-tile,amx-bf16")

namespace sgl_cpu {
namespace {

// attend_span's per-thread scratch: every chunk's transposed K and paired V, the q rows of every
// unit, and the block's scores, probabilities and accumulators (~260 KB at head_dim 64)
struct SpanScratch {
  static constexpr int64_t kChunks = PART / CHUNK + 1, kUnits = TILE * MAX_GROUP, kMaxD = 64;
  alignas(64) uint32_t kt[kChunks][kMaxD / 2 * CHUNK];
  alignas(64) uint32_t vp[kChunks][CHUNK / 2 * kMaxD];
  alignas(64) c10::BFloat16 qb[(kUnits + 16) * kMaxD];
  alignas(64) float s[16 * CHUNK], o[16 * kMaxD];
  alignas(64) c10::BFloat16 pb[16 * CHUNK];
  static SpanScratch& get() {
    static thread_local std::unique_ptr<SpanScratch> mine;
    if (!mine) mine.reset(new SpanScratch);
    return *mine;
  }
};

// 2^x for softmax probabilities that are rounded to bfloat16 (8 significant bits): a degree-3
// polynomial on [-1/2, 1/2] (relative error 7.5e-5, least squares weighted to minimax, fitted
// 2026-11-30) times 2^n; 7 operations where exp2_512 takes 9. x < -126 (so -inf) gives 0.
inline __m512 exp2_p(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(0.05517605319619179f), r, _mm512_set1_ps(0.24261149764060974f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.6932601928710938f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.9999280571937561f));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

struct AmxChunk {
  static constexpr bool kPrescaled = false, kStage = false, kBase2 = true;
  // head_dim 32 or 64 over bfloat16 K/V: attend_span (the accumulators fit 4 tiles)
  template <int NV, typename KV>
  static constexpr bool kSpan = std::is_same_v<KV, c10::BFloat16> && (NV == 4 || NV == 8);
  // A row's running max is raised only when a chunk's max exceeds it by more than this (base 2):
  // p <= 2^8, and the accumulators stay in their tiles (FlashAttention-4's conditional rescale)
  static constexpr float kRescaleGap = 8.0f;

  // Each work item configures the tiles of its thread (amx_tiles.h).
  static void begin_item() { sgl_cpu_vnni::load_tile_config(); }

  // One work item (attend_tile's arguments) with the loops the other way round: every chunk's K
  // and V laid out for the tiles once, then for each block of 16 units (query token x head) all
  // chunks in order, the block's P.V accumulators held in tiles 0-3 throughout. Per chunk: S =
  // q . k^T (tiles 4, 5), its scores to memory for the online softmax (in base 2, p rounded to
  // bf16), then P.V added to the accumulators. A row's max m moves only by more than
  // kRescaleGap, so the accumulators leave their tiles (to be multiplied by 2^(m_old - m_new))
  // only then: a few times a row. Each row's arithmetic depends on its own scores alone, and a
  // chunk holding none of a row's positions leaves its m, l and accumulators as they were, so
  // a token's output is bitwise the same in any tile, batch or pass.
  template <int NV>
  static void attend_span(const float* const* q, const Row* rows, int nrows, int group,
                          const c10::BFloat16* kbuf, const c10::BFloat16* vbuf,
                          int64_t row_stride, const int64_t* slots, int64_t a, int64_t e,
                          float scale, float softcap, bool l2) {
    constexpr int64_t D = 8 * NV;
    SpanScratch& sp = SpanScratch::get();
    const int64_t c_first = (a / CHUNK) * CHUNK;
    const int nch = static_cast<int>((e - c_first + CHUNK - 1) / CHUNK);
    // The first block lays out each chunk's K and V just before its products, so their reads
    // from memory overlap its tile work (one block is all a decode item has: then into one
    // slot, which stays in L1)
    const int units = nrows * group;
    const bool one_block = units <= 16;
    auto stage = [&](int ci) {
      ChunkRows<c10::BFloat16> cr;
      cr.ahead_bytes = D * 2;
      cr.ahead_l2 = l2;
      chunk_rows_at(cr, c_first + ci * CHUNK, a, e, kbuf, vbuf, row_stride, slots);
      transpose_k<D>(cr, sp.kt[one_block ? 0 : ci]);
      interleave_v<D>(cr, sp.vp[one_block ? 0 : ci]);
    };
    for (int u = 0; u < units; ++u) {  // q as it came: bfloat16
      const c10::BFloat16* src = reinterpret_cast<const c10::BFloat16*>(q[u]);
      for (int64_t d = 0; d < D; d += 32)
        _mm512_store_si512(sp.qb + u * D + d, _mm512_loadu_si512(src + d));
    }
    for (int u = units; u < (units + 15) / 16 * 16; ++u)  // padding rows: zero, never read
      for (int64_t d = 0; d < D; d += 32)
        _mm512_store_si512(sp.qb + u * D + d, _mm512_setzero_si512());
    for (int u0 = 0; u0 < units; u0 += 16)
      span_block<D>(sp, rows, group, u0, std::min(16, units - u0), a, e, c_first, nch, scale,
                    softcap, u0 == 0 ? &stage : nullptr, one_block);
  }

  // The online-softmax step of span_block's rows over the chunk at c0, from their scores in
  // sp.s: the mask ([lo, hi) per row), base-2 scores x, and p = 2^(x - m) as bf16 into sp.pb
  // (rows without positions here: 0), added to the row's 16 lane sums lv[row]. A row's max m
  // is raised only where some x exceeds it by more than kRescaleGap (to the chunk's max; its
  // lane sums then times corr = 2^(m_old - m_new)), so the common step is a compare of x - m
  // that exp2 needs anyway, no max across lanes. Writes corr[row] (1 where m stays). True
  // where some row's accumulators need corr.
  static bool span_softmax(SpanScratch& sp, int n, const int64_t* lo, const int64_t* hi,
                           int64_t c0, __m512 qk_scale, float softcap, float* mu, __m512* lv,
                           float* corr) {
    const __m512 neg_inf = _mm512_set1_ps(NEG_INF), gap = _mm512_set1_ps(kRescaleGap);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    bool rescale = false;
    for (int i = 0; i < 16; ++i) {
      corr[i] = 1.0f;
      if (i >= n || hi[i] <= c0 || lo[i] >= c0 + CHUNK) {  // none of its positions here
        _mm512_store_si512(sp.pb + i * CHUNK, _mm512_setzero_si512());
        continue;
      }
      __m512 x[2] = {_mm512_mul_ps(_mm512_load_ps(sp.s + i * CHUNK), qk_scale),
                     _mm512_mul_ps(_mm512_load_ps(sp.s + i * CHUNK + 16), qk_scale)};
      cap_and_mask<true>(x, softcap, nullptr);  // soft-capping (then base 2); masks below
      if (lo[i] > c0 || hi[i] < c0 + CHUNK)  // lanes outside [lo, hi): -inf
        for (int h = 0; h < 2; ++h) {
          const int first = static_cast<int>(c0 + 16 * h - lo[i]), len = static_cast<int>(hi[i] - lo[i]);
          const __m512i off = _mm512_add_epi32(_mm512_set1_epi32(first), lane);
          const __mmask16 in = _mm512_cmplt_epu32_mask(off, _mm512_set1_epi32(len));
          x[h] = _mm512_mask_blend_ps(in, neg_inf, x[h]);
        }
      float m = mu[i];
      __m512 mv = _mm512_set1_ps(m), d0 = _mm512_sub_ps(x[0], mv), d1 = _mm512_sub_ps(x[1], mv);
      // the row's first positions (m = -inf: d = +inf or NaN), or some x past m + gap
      const __mmask16 past =
          _mm512_cmp_ps_mask(d0, gap, _CMP_GT_OQ) | _mm512_cmp_ps_mask(d1, gap, _CMP_GT_OQ);
      if (m == NEG_INF || past) {
        const float cmax = _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1]));
        if (m != NEG_INF) {
          corr[i] = exp2_512(_mm512_set1_ps(m - cmax))[0];
          lv[i] = _mm512_mul_ps(lv[i], _mm512_set1_ps(corr[i]));
          rescale = true;
        }
        mu[i] = m = cmax;
        mv = _mm512_set1_ps(m);
        d0 = _mm512_sub_ps(x[0], mv);
        d1 = _mm512_sub_ps(x[1], mv);
      }
      const __m512 p0 = exp2_p(d0), p1 = exp2_p(d1);  // 0 on masked lanes
      _mm512_store_si512(sp.pb + i * CHUNK, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      lv[i] = _mm512_add_ps(lv[i], _mm512_add_ps(p0, p1));
    }
    return rescale;
  }

  // The D / 16 accumulator tiles (0-3) to / from o [16][D] float32.
  template <int64_t D>
  static void store_acc(float* o) {
    _tile_stored(0, o, 4 * D);
    _tile_stored(1, o + 16, 4 * D);
    if constexpr (D == 64) {
      _tile_stored(2, o + 32, 4 * D);
      _tile_stored(3, o + 48, 4 * D);
    }
  }
  template <int64_t D>
  static void load_acc(const float* o) {
    _tile_loadd(0, o, 4 * D);
    _tile_loadd(1, o + 16, 4 * D);
    if constexpr (D == 64) {
      _tile_loadd(2, o + 32, 4 * D);
      _tile_loadd(3, o + 48, 4 * D);
    }
  }

  // attend_span's units u0 .. u0 + n - 1 over its nch chunks (first laying each out with stage,
  // where given); writes their m, l, acc to out. One function: tiles 0-3 hold the block's
  // accumulators from its first chunk to its last.
  template <int64_t D, typename Stage>
  static void span_block(SpanScratch& sp, const Row* rows, int group, int u0, int n, int64_t a,
                         int64_t e, int64_t c_first, int nch, float scale, float softcap,
                         Stage* stage, bool one_slot) {
    constexpr int NT = D / 16;  // accumulator tiles
    int64_t lo[16], hi[16];
    for (int i = 0; i < 16; ++i) {
      const Row* r = i < n ? &rows[(u0 + i) / group] : nullptr;
      lo[i] = r ? std::max(a, r->lo) : 0;
      hi[i] = r ? std::min(e, r->pos + 1) : 0;
    }
    const __m512 qk_scale = _mm512_set1_ps(softcap > 0.0f ? scale : scale * LOG2E);
    alignas(64) float mu[16], corr[16];  // per row
    __m512 lv[16];                        // per row: its sum of p, 16 lanes
    for (int i = 0; i < 16; ++i) mu[i] = NEG_INF, lv[i] = _mm512_setzero_ps();
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NT == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int ci = 0; ci < nch; ++ci) {
      const int64_t c0 = c_first + ci * CHUNK;
      if (stage != nullptr) (*stage)(ci);
      const uint32_t* kt = sp.kt[one_slot ? 0 : ci];
      const uint32_t* vp = sp.vp[one_slot ? 0 : ci];
      bool any = false;
      for (int i = 0; i < n; ++i) any |= hi[i] > c0 && lo[i] < c0 + CHUNK;
      if (!any) continue;  // no row's positions: nothing changes
      _tile_zero(4);
      _tile_zero(5);
      for (int64_t j = 0; j < D / 32; ++j) {  // 32 dims (16 pairs) a step, in order
        _tile_loadd(6, sp.qb + u0 * D + 32 * j, 2 * D);
        _tile_loadd(7, kt + 16 * j * CHUNK, 4 * CHUNK);
        _tile_dpbf16ps(4, 6, 7);
        _tile_loadd(7, kt + 16 * j * CHUNK + 16, 4 * CHUNK);
        _tile_dpbf16ps(5, 6, 7);
      }
      _tile_stored(4, sp.s, 4 * CHUNK);
      _tile_stored(5, sp.s + 16, 4 * CHUNK);
      if (span_softmax(sp, n, lo, hi, c0, qk_scale, softcap, mu, lv, corr)) {
        // some row's sums so far times 2^(m_old - m_new)
        store_acc<D>(sp.o);
        for (int i = 0; i < n; ++i) {
          const float c = corr[i];
          if (c == 1.0f) continue;
          for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(sp.o + i * D + d,
                            _mm512_mul_ps(_mm512_load_ps(sp.o + i * D + d), _mm512_set1_ps(c)));
        }
        load_acc<D>(sp.o);
      }
      _tile_loadd(6, sp.pb, 2 * CHUNK);  // P: 16 rows x 16 position pairs
      _tile_loadd(7, vp, 4 * D);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(4, vp + 16, 4 * D);
      _tile_dpbf16ps(1, 6, 4);
      if constexpr (NT == 4) {
        _tile_loadd(5, vp + 32, 4 * D);
        _tile_dpbf16ps(2, 6, 5);
        _tile_loadd(7, vp + 48, 4 * D);
        _tile_dpbf16ps(3, 6, 7);
      }
    }
    store_acc<D>(sp.o);
    for (int i = 0; i < n; ++i) {
      float* out = rows[(u0 + i) / group].out + ((u0 + i) % group) * (D + 2);
      out[0] = mu[i];
      out[1] = _mm512_reduce_add_ps(lv[i]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(out + 2 + d, _mm512_load_ps(sp.o + i * D + d));
    }
  }

  template <int NV, typename T>
  static void attend(const ChunkRows<T>& rows, int units, const float* const* q,
                     float* const* out, const float* const* valid, float scale, float softcap,
                     float* prs) {
    if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 4 == 0) {
      constexpr int64_t D = 8 * NV;
      alignas(64) uint32_t kt[D / 2 * CHUNK];
      alignas(64) uint32_t vp[CHUNK / 2 * D];
      alignas(64) c10::BFloat16 qb[16 * D];  // a block's q rows
      alignas(64) float s[16 * CHUNK];        // its scores
      alignas(64) uint32_t pb[16 * CHUNK / 2];  // its probabilities (bf16 pairs)
      alignas(64) float o[16 * D];            // its rescaled accumulators
      float corrs[TILE * MAX_GROUP];
      transpose_k<D>(rows, kt);
      interleave_v<D>(rows, vp);
      // scores in base 2 (kBase2): log2(e) folded into the scale, or applied after capping
      const __m512 qk_scale = _mm512_set1_ps(softcap > 0.0f ? scale : scale * LOG2E);
      for (int u0 = 0; u0 < units; u0 += 16) {
        const int n = std::min(16, units - u0);
        // Rows past the block's n units are left as they are (stale or never written): a C
        // row depends only on its own A row, and those rows' results are never read.
        for (int i = 0; i < n; ++i) {  // the driver passes q as it came: bfloat16
          const c10::BFloat16* src = reinterpret_cast<const c10::BFloat16*>(q[u0 + i]);
          for (int64_t d = 0; d < D; d += 32) _mm512_store_si512(qb + i * D + d, _mm512_loadu_si512(src + d));
        }
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t j = 0; j < D / 32; ++j) {  // 32 dims (16 pairs) a step, in order
          _tile_loadd(4, qb + 32 * j, 2 * D);
          _tile_loadd(6, kt + 16 * j * CHUNK, 4 * CHUNK);
          _tile_loadd(7, kt + 16 * j * CHUNK + 16, 4 * CHUNK);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, s, 4 * CHUNK);
        _tile_stored(1, s + 16, 4 * CHUNK);
        __m512 sc[16][CHUNK / 16];
        for (int i = 0; i < n; ++i) {
          sc[i][0] = _mm512_mul_ps(_mm512_load_ps(s + i * CHUNK), qk_scale);
          sc[i][1] = _mm512_mul_ps(_mm512_load_ps(s + i * CHUNK + 16), qk_scale);
        }
        // p in bf16; the two softmax steps give the same bits (attention_chunk512.h), the
        // 16-lane one pays for 16 units however few there are
        if (n < 8) softmax_step<true, true>(sc, n, u0, out, valid, softcap, prs, corrs);
        else softmax_step16<true, true>(sc, n, u0, out, valid, softcap, prs, corrs);
        for (int i = 0; i < n; ++i) {
          _mm512_store_si512(pb + i * CHUNK / 2, _mm512_loadu_si512(prs + (u0 + i) * CHUNK));
          const __m512 c = _mm512_set1_ps(corrs[u0 + i]);
          const float* acc = out[u0 + i] + 2;
          for (int64_t d = 0; d < D; d += 16)
            _mm512_store_ps(o + i * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), c));
        }
        _tile_loadd(4, pb, 2 * CHUNK);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {  // 16 dims a tile
          _tile_loadd(0, o + d0, 4 * D);
          _tile_loadd(6, vp + d0, 4 * D);
          _tile_dpbf16ps(0, 4, 6);
          _tile_stored(0, o + d0, 4 * D);
        }
        for (int i = 0; i < n; ++i) {
          float* acc = out[u0 + i] + 2;
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_load_ps(o + i * D + d));
        }
      }
    } else {
      TORCH_CHECK(false, "attention_amx runs bfloat16 K/V with head_dim a multiple of 32");
    }
  }
};

}  // namespace
}  // namespace sgl_cpu

#pragma GCC pop_options

namespace sgl_cpu_vnni {

// As sgl_cpu::attention, on the AMX kernel (attention_entry.h). Raises where the machine gives
// no AMX tiles.
at::Tensor attention_amx(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                         const at::Tensor& req_to_token, const at::Tensor& req_rows,
                         const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                         double scale, int64_t window, double softcap) {
  TORCH_CHECK(amx_available(), "attention_amx needs AMX-BF16 tiles (amx_available() is false)");
  return attention_on_bf16_chunk<sgl_cpu::AmxChunk>(q, k_buf, v_buf, req_to_token, req_rows,
                                                    prefix_lens, extend_lens, scale, window,
                                                    softcap);
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY_FRAGMENT(sgl_cpu_vnni, m) { m.def(SGL_ATTENTION_SCHEMA("attention_amx")); }

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) {
  m.impl("attention_amx", &sgl_cpu_vnni::attention_amx);
}
