// What sgl_cpu::attention's driver (attention_impl.h) and its per-ISA chunk kernels
// (attention_chunk.h: AVX2, csrc_vnni/attention_chunk512.h: AVX-512) share: the chunk and tile
// sizes and the K/V rows of one chunk.
#pragma once

#include <immintrin.h>

#include "prefetch.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace sgl_cpu {
namespace {

constexpr int64_t CHUNK = 32;  // positions per online-softmax step (aligned to multiples of it)
constexpr int64_t TILE = 64;        // query tokens of one sequence per work item, at most
constexpr int64_t SMALL_TILE = 32;  // ... or this many where TILE leaves too few items
constexpr int MAX_GROUP = 16;  // query heads per KV head
constexpr int MAX_D = 256;     // head_dim, at most
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// A chunk kernel (attention_chunk.h's Avx2Chunk, csrc_vnni/attention_chunk512.h's Avx512Chunk,
// csrc_vnni/attention_bf16.cpp's Bf16Chunk) provides
//   template <int NV, typename T> static void attend(const ChunkRows<T>& rows, int units,
//       const float* const* q, float* const* out, const float* const* valid, float scale,
//       float softcap, float* prs);
// one chunk of the online softmax for `units` (query token, head) units: q[u] [8 NV] float32
// multiplied by scale where kPrescaled, else q's own elements as they came (bfloat16 pairs for
// the one such kernel, which scales the scores), out[u] =
// (running max m, running sum l, acc [8 NV]) updated in place, valid[u] [CHUNK] 0 / -inf per
// position (nullptr: every position valid), prs scratch [units][CHUNK] floats; and
//   static constexpr bool kPrescaled, kStage, kBase2;
// kStage: bfloat16 K/V rows shared by many units may be staged as float32 (else rows are
// always passed in place); kBase2: its scores, running max m and exponentials are in base 2
// (scores scaled by log2(e), exp2), else base e. Each unit's arithmetic must not depend on
// the other units it is computed with. Optionally static void begin_item(), called on the
// thread that runs a work item before its chunks (the AMX kernel configures its tiles there),
// and template <int NV, typename KV> static constexpr bool kSpan: where true, attend_tile hands
// the whole item to Chunk::attend_span<NV>(attend_tile's arguments but the scratch), which
// runs its chunks itself and writes every unit's partial (m, l, acc).

inline float exp1(float x) {
  alignas(32) float buf[8] = {x, 0, 0, 0, 0, 0, 0, 0};
  _mm256_store_ps(buf, exp256(_mm256_load_ps(buf)));
  return buf[0];
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Rows of one chunk: for each of its CHUNK positions, the K and V rows (float32 or bfloat16,
// [D] each), or nullptr for positions outside [a, e) (their scores are masked, they add nothing).
// Prefetch `bytes` from p, a cache line at a time (nothing when p is nullptr), into L2 (l2, see
// prefetch_into_l2: the caller reads it once a call) or L1.
inline __attribute__((always_inline)) void prefetch_row(const char* p, int64_t bytes, bool l2) {
  if (p != nullptr)
    for (int64_t b = 0; b < bytes; b += 64) prefetch_line(p + b, l2);
}

template <typename T>
struct ChunkRows {
  const T* k[CHUNK];
  const T* v[CHUNK];
  const char* ahead[CHUNK][2];  // K and V rows AHEAD positions on, to prefetch (or nullptr)
  int64_t ahead_bytes;          // bytes per such row
  bool ahead_l2;                // prefetched into L2 (prefetch_into_l2), else L1

  // Prefetch the K (which = 0) or V (1) row AHEAD positions after position j, if any: rows
  // scattered by slot index defeat the hardware prefetchers; one row per row read spreads the
  // misses over the compute instead of bursting them.
  __attribute__((always_inline)) void prefetch(int64_t j, int which) const {
    prefetch_row(ahead[j][which], ahead_bytes, ahead_l2);
  }
};

}  // namespace
}  // namespace sgl_cpu
