// Weight-quantized linear layers on AVX2 FMA (sgl_cpu::int4_linear, sgl_cpu::int8_linear):
// each weight is dequantized to float32 in registers (w = d * q + m for int4 blocks of 32,
// w = q for int8 rows, whose scale is applied to the finished sum) and multiplied with the
// float32 activations (bfloat16 ones are widened exactly); nothing dense is stored, so a
// pass reads 4 (int4) or 8 (int8) bits per weight. Register tiles of NT output features x MT
// activation rows reuse each dequantized weight vector MT times, so prefill runs near the FMA
// units' peak and decode near the memory bandwidth.
//
// Batch invariance: output y[m, n] is one accumulator vector fed by the same FMA sequence (k
// in order, 8 lanes) whatever M is, which tile the row falls in and how the features are split
// over threads; its lanes are summed in one fixed order. So a row's result never depends on
// the other rows of the batch (a decode step, a verify pass and a prefill agree bitwise).
//
// int4 block (20 bytes, one per 32 weights of a row): fp16 d, fp16 m, 16 bytes of nibbles
// (byte j: weight j in the low nibble, weight j + 16 in the high one), GGUF Q4_1's layout
// (ggml-common.h block_q4_1); w = d * q + m, q in [0, 15].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "linear_inputs.h"
#include "register_tiles.h"
#include "vec.h"

#include <cstring>
#include <type_traits>
#include <vector>

namespace sgl_cpu {
namespace {

constexpr int64_t QK = 32;     // weights per block
constexpr int64_t Q4_BYTES = 20;
constexpr int64_t NT = 2;      // output features per register tile
constexpr int64_t MAX_MT = MAX_TILE_ROWS;  // activation rows per register tile
constexpr int64_t MB = 60;     // activation rows per cache block (a multiple of MAX_MT)

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

template <typename T>
inline void store(T* y, float v) { *y = static_cast<T>(v); }

// Eight int4 weights k = 8s .. 8s+7 of a block as float32: d * q + m.
inline __m256 dequant_q4(const uint8_t* qs, int s, __m256 d, __m256 m) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * (s & 1)));
  if (s >= 2) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
  return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), m);
}

inline __m256 dequant_q8(const int8_t* q) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// y[m, n] for MT rows of x (stride K) and NTILE int4 weight rows (stride row_bytes).
template <int NTILE, int MT, typename T>
inline void q4_tile(const uint8_t* w, int64_t row_bytes, int64_t K, const T* x, T* y,
                    int64_t ldy) {
  __m256 acc[NTILE][MT];
  for (int i = 0; i < NTILE; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / QK; ++g) {
    __m256 d[NTILE], m[NTILE];
    const uint8_t* qs[NTILE];
    for (int i = 0; i < NTILE; ++i) {
      const uint8_t* b = w + i * row_bytes + g * Q4_BYTES;
      uint16_t hd, hm;
      std::memcpy(&hd, b, 2);
      std::memcpy(&hm, b + 2, 2);
      d[i] = _mm256_set1_ps(half_to_float(hd));
      m[i] = _mm256_set1_ps(half_to_float(hm));
      qs[i] = b + 4;
    }
    for (int s = 0; s < 4; ++s) {
      const int64_t k = g * QK + 8 * s;
      // weights k .. k+7 are low nibbles of bytes s*8.. (s < 2) or high nibbles (s >= 2),
      // which hold k - 16; the block's order is k = 0..31 either way
      __m256 wv[NTILE];
      for (int i = 0; i < NTILE; ++i) wv[i] = dequant_q4(qs[i], s, d[i], m[i]);
      for (int j = 0; j < MT; ++j) {
        const __m256 xv = load8(x + j * K + k);
        for (int i = 0; i < NTILE; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
      }
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < NTILE; ++i) store(y + j * ldy + i, hsum(acc[i][j]));
}

// Dequantize NTILE int4 rows of K weights into wf (row i at wf + i * K), the same values
// q4_tile computes in registers.
template <int NTILE>
inline void q4_panel(const uint8_t* w, int64_t row_bytes, int64_t K, float* wf) {
  for (int i = 0; i < NTILE; ++i) {
    for (int64_t g = 0; g < K / QK; ++g) {
      const uint8_t* b = w + i * row_bytes + g * Q4_BYTES;
      uint16_t hd, hm;
      std::memcpy(&hd, b, 2);
      std::memcpy(&hm, b + 2, 2);
      const __m256 d = _mm256_set1_ps(half_to_float(hd)), m = _mm256_set1_ps(half_to_float(hm));
      for (int s = 0; s < 4; ++s)
        _mm256_storeu_ps(wf + i * K + g * QK + 8 * s, dequant_q4(b + 4, s, d, m));
    }
  }
}

template <int NTILE>
inline void q8_panel(const int8_t* w, int64_t K, float* wf) {
  for (int i = 0; i < NTILE; ++i)
    for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(wf + i * K + k, dequant_q8(w + i * K + k));
}

// y[m, n] = sum_k wf[n, k] x[m, k] (times scale[n] when given) over dequantized panel rows:
// the same FMA sequence per (m, n) as q4_tile / q8_tile.
template <int NTILE, int MT, typename T>
inline void f32_tile(const float* wf, int64_t K, const T* x, T* y, int64_t ldy,
                     const float* scale) {
  __m256 acc[NTILE][MT];
  for (int i = 0; i < NTILE; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NTILE];
    for (int i = 0; i < NTILE; ++i) wv[i] = _mm256_loadu_ps(wf + i * K + k);
    for (int j = 0; j < MT; ++j) {
      const __m256 xv = load8(x + j * K + k);
      for (int i = 0; i < NTILE; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < NTILE; ++i)
      store(y + j * ldy + i, scale ? hsum(acc[i][j]) * scale[i] : hsum(acc[i][j]));
}

template <int NTILE, int MT, typename T>
inline void q8_tile(const int8_t* w, int64_t K, const float* scale, const T* x, T* y,
                    int64_t ldy) {
  __m256 acc[NTILE][MT];
  for (int i = 0; i < NTILE; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NTILE];
    for (int i = 0; i < NTILE; ++i) wv[i] = dequant_q8(w + i * K + k);
    for (int j = 0; j < MT; ++j) {
      const __m256 xv = load8(x + j * K + k);
      for (int i = 0; i < NTILE; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int j = 0; j < MT; ++j)
    for (int i = 0; i < NTILE; ++i) store(y + j * ldy + i, hsum(acc[i][j]) * scale[i]);
}

// Runs the tiles of [0, N) x [0, M): features split over threads, rows in cache blocks of MB.
// Up to MAX_MT rows, tile(n0, nt, m0, mt, nullptr) dequantizes in registers; for more,
// panel(n0, nt, buf) first dequantizes the NT features' weights into a thread-local buffer
// once per block and tile(..., buf) reads them from there.
template <typename Panel, typename Tile>
void for_tiles(int64_t N, int64_t M, int64_t K, Panel panel, Tile tile) {
  const int64_t tiles = (N + NT - 1) / NT;
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> buf(M > MAX_MT ? NT * K : 0);
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m1 = std::min(M, m0 + MB);
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t n0 = t * NT, nt = std::min(NT, N - n0);
        const float* wf = nullptr;
        if (M > MAX_MT) {
          panel(n0, nt, buf.data());
          wf = buf.data();
        }
        for (int64_t m = m0; m < m1; m += MAX_MT) tile(n0, nt, m, std::min(MAX_MT, m1 - m), wf);
      }
    }
  });
}

// Calls f.template operator()<NTILE, MT>() for a runtime nt (NT or 1) and mt (1..MAX_MT).
template <typename F>
inline void with_tile(int64_t nt, int64_t mt, F&& f) {
  if (nt == NT) with_rows<NT>(mt, f);
  else with_rows<1>(mt, f);
}

}  // namespace

// q [N, K] uint8 in [0, 15], scale/zero [N, K / 32] float32 with w = (q - 8) * scale + zero
// (server.model.quantization's int4 convention) -> packed [N, K / 32 * 20] uint8.
at::Tensor pack_int4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero) {
  const Int4Source src = int4_source(q, scale, zero);
  const int64_t G = src.G;
  auto out = at::empty({src.N, G * Q4_BYTES}, q.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, src.N, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* b = op + (n * G + g) * Q4_BYTES;
        const auto [hd, hm] = src.dm(n, g);
        std::memcpy(b, &hd, 2);
        std::memcpy(b + 2, &hm, 2);
        const uint8_t* w = src.row(n, g);
        for (int j = 0; j < 16; ++j) b[4 + j] = (w[j] & 0x0F) | ((w[j + 16] & 0x0F) << 4);
      }
    }
  });
  return out;
}

// x [M, K] float32/bfloat16, packed from pack_int4 -> y [M, N] in x's dtype.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  const int64_t K = x.size(1), G = K / QK, M = x.size(0);
  check_x(x, K, QK);
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == N && packed.size(1) == G * Q4_BYTES &&
              packed.is_contiguous(), "packed must be a contiguous [", N, ", ", G * Q4_BYTES,
              "] tensor (pack_int4 of a [N, K] weight)");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t row_bytes = G * Q4_BYTES;
  auto run = [&](auto* xp, auto* yp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    auto panel = [&](int64_t n0, int64_t nt, float* wf) {
      if (nt == NT) q4_panel<NT>(w + n0 * row_bytes, row_bytes, K, wf);
      else q4_panel<1>(w + n0 * row_bytes, row_bytes, K, wf);
    };
    for_tiles(N, M, K, panel, [&](int64_t n0, int64_t nt, int64_t m0, int64_t mt, const float* wf) {
      with_tile(nt, mt, [&]<int NTI, int MTI>() {
        if (wf) f32_tile<NTI, MTI, T>(wf, K, xp + m0 * K, yp + m0 * N + n0, N, nullptr);
        else q4_tile<NTI, MTI, T>(w + n0 * row_bytes, row_bytes, K, xp + m0 * K, yp + m0 * N + n0, N);
      });
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), y.data_ptr<float>());
  else run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  return y;
}

// x [M, K] float32/bfloat16 (K % 8 == 0), w [N, K] int8, scale [N] float32 -> y [M, N].
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  const int64_t K = x.size(1), M = x.size(0);
  check_x(x, K, 8);
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kChar &&
              w.is_contiguous(), "w must be a contiguous [N, ", K, "] int8 tensor");
  const int64_t N = w.size(0);
  TORCH_CHECK(scale.numel() == N && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "scale must be a contiguous [N] float32 tensor");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto run = [&](auto* xp, auto* yp) {
    using T = std::remove_pointer_t<decltype(xp)>;
    auto panel = [&](int64_t n0, int64_t nt, float* wf) {
      if (nt == NT) q8_panel<NT>(wp + n0 * K, K, wf);
      else q8_panel<1>(wp + n0 * K, K, wf);
    };
    for_tiles(N, M, K, panel, [&](int64_t n0, int64_t nt, int64_t m0, int64_t mt, const float* wf) {
      with_tile(nt, mt, [&]<int NTI, int MTI>() {
        if (wf) f32_tile<NTI, MTI, T>(wf, K, xp + m0 * K, yp + m0 * N + n0, N, sp + n0);
        else q8_tile<NTI, MTI, T>(wp + n0 * K, K, sp + n0, xp + m0 * K, yp + m0 * N + n0, N);
      });
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), y.data_ptr<float>());
  else run(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace sgl_cpu
