// sgl_cpu_vnni::attention_amx: the attention driver (../csrc/attention_impl.h) on a chunk
// kernel whose two products run on AMX bf16 tiles (TDPBF16PS: 16 rows x 16 columns x 32 bf16
// products an instruction, float32 accumulation), for bfloat16 queries over a bfloat16 KV
// pool with head_dim a multiple of 32; other inputs run the float32 AVX-512 kernel
// (attention512.cpp). On Sapphire Rapids vdpbf16ps (attention_bf16.cpp's kernel) issues one a
// cycle at best, half the float32 FMA rate (74 GFLOP/s a core measured, 2026-11-29), where a
// tile instruction does 16,384 FLOP in ~16 cycles.
//
// Per chunk of 32 positions the K rows are transposed into pair columns and the V rows
// interleaved in position pairs (attention_pairs.h: the B layouts TDPBF16PS reads), then for
// each block of up to 16 units (a unit: one query token x head): S = q . k^T into two 16 x 16
// float32 tiles (positions 0-15, 16-31) summed over the head dim 32 at a time in order, times
// scale; the online-softmax step of attention_chunk512.h (softmax_step16, base 2 as
// attention_bf16.cpp's kernel, p rounded to bf16); then acc = acc * rescale + P.V, the
// rescaled accumulators loaded into tiles and the 16 position pairs of the chunk added by one
// instruction per 16 dims. Every chunk of every pass, decode or extend, runs this same code,
// so a token's output is bitwise the same in any pass; its bits differ from the other kernels'
// (the order of the sums within an instruction is the hardware's).
#include <torch/library.h>

#include "../csrc/attention_impl.h"
#include "amx_tiles.h"
#include "attention_chunk512.h"
#include "attention_entry.h"
#include "attention_pairs.h"

#pragma GCC push_options
#pragma GCC target("avx512bf16,amx-tile,amx-bf16")

namespace sgl_cpu {
namespace {

struct AmxChunk {
  static constexpr bool kPrescaled = false, kStage = false, kBase2 = true;

  // Each work item configures the tiles of its thread (amx_tiles.h).
  static void begin_item() { sgl_cpu_vnni::load_tile_config(); }

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
