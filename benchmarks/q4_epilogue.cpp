// What bounds the VNNI int4 linear (kernels/cpu/csrc_vnni/vnni_linear.cpp) at prefill: its
// register tile (2 feature tiles x 6 rows, 8 vpdpbusd per 32-input block and (tile, row)) run
// over a weight and activations that stay in L2, one core, with the per-block float epilogue
// of each variant below. The loop is a copy of the kernel's q4_tile (each variant needs its
// own epilogue, compiled in). A standalone program, not part of the server:
//
//   g++ -O3 -std=c++20 -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma \
//       benchmarks/q4_epilogue.cpp -o /tmp/q4_epilogue && taskset -c 1 /tmp/q4_epilogue
//
// Variants (TOP/s = 2 M N K / best of 7 seconds, K = 576, N = 1536, M = 264):
//   q4_1 x q8_1   the kernel's epilogue: convert, d * dx, 2 FMAs (Q4_1 min term)
//   ints only     no epilogue: the block sums added as integers (the vpdpbusd peak)
//   no d*dx mul   convert + 2 FMAs (as with one activation scale per row)
//   pow2 shift    convert(sum << e) + 2 FMAs (power-of-two block scales, integer shift)
//   pow2 expadd   convert, exponent add (vpaddd) + 2 FMAs (power-of-two block scales)
//   one fma       convert + 1 FMA (no min term)
// 2026-11-27, 2-core AMD EPYC Zen 4 (avx512_vnni, avx512_bf16): 0.325 / 0.445 / 0.361 / 0.324 /
// 0.341 / 0.403: each float op of the epilogue takes a vpdpbusd slot (the same two pipes), so
// Q4_1 x Q8_1 runs at 8 / 11 of the peak; only a change of the activations' numerics (one
// scale per row: 8 / 10) would lift it, not a change of the code.
// 2026-11-28, 2-core AMD EPYC Zen 5 (512-bit units): 0.774 / 1.073 / 0.857 / 0.780 / 0.762 /
// 0.956: the same model fits exactly (dpbusd, mul and FMA share two pipes, the convert runs
// beside them: 8 / 11, 8 / 10, 8 / 9 of the integer peak): without the Q4_1 min term's FMA
// the tile would run 1.23x, with one scale per row 1.11x; both change the arithmetic.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int Q4_BLOCK = 320;  // bytes per (16-feature tile, 32-input block), as the kernel's
enum Variant { Q4_1, INTS, NO_MUL, POW2_SHIFT, POW2_EXPADD, ONE_FMA };

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int NT, int MT, Variant V>
__attribute__((noinline)) void tile(const uint8_t* const (&w)[NT], int64_t G, const int8_t* qx,
                                    const float* dx, const float* cx, int64_t K, float* y,
                                    int64_t ldy) {
  __m512 facc[NT][MT];
  __m512i iacc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int r = 0; r < MT; ++r) facc[i][r] = _mm512_setzero_ps(), iacc[i][r] = _mm512_setzero_si512();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[NT][MT];
    for (int i = 0; i < NT; ++i)
      for (int r = 0; r < MT; ++r) acc[i][r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m512i lo[NT], hi[NT];
      for (int i = 0; i < NT; ++i) {
        const __m512i v = _mm512_loadu_si512(w[i] + g * Q4_BLOCK + 64 + 64 * c);
        lo[i] = _mm512_and_si512(v, low);
        hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < MT; ++r) {
        const int8_t* xr = qx + r * K + g * 32 + 8 * c;
        const __m512i xa = bcast4(xr), xb = bcast4(xr + 4);
        for (int i = 0; i < NT; ++i) {
          acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], lo[i], xa);
          acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], hi[i], xb);
        }
      }
    }
    for (int i = 0; i < NT; ++i) {
      const uint8_t* b = w[i] + g * Q4_BLOCK;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32)));
      for (int r = 0; r < MT; ++r) {
        const float s = dx[r * G + g];
        __m512 isum;
        if constexpr (V == INTS) {
          iacc[i][r] = _mm512_add_epi32(iacc[i][r], acc[i][r]);
          continue;
        } else if constexpr (V == POW2_SHIFT) {
          isum = _mm512_cvtepi32_ps(_mm512_sll_epi32(acc[i][r], _mm_cvtsi32_si128(int(s))));
        } else if constexpr (V == POW2_EXPADD) {
          isum = _mm512_castsi512_ps(_mm512_add_epi32(
              _mm512_castps_si512(_mm512_cvtepi32_ps(acc[i][r])), _mm512_set1_epi32(int(s) << 23)));
        } else {
          isum = _mm512_cvtepi32_ps(acc[i][r]);
        }
        if constexpr (V == Q4_1)
          facc[i][r] = _mm512_fmadd_ps(isum, _mm512_mul_ps(d, _mm512_set1_ps(s)), facc[i][r]);
        else
          facc[i][r] = _mm512_fmadd_ps(isum, d, facc[i][r]);
        if constexpr (V != ONE_FMA)
          facc[i][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(cx[r * G + g]), facc[i][r]);
      }
    }
  }
  for (int r = 0; r < MT; ++r)
    for (int i = 0; i < NT; ++i)
      _mm512_storeu_ps(y + r * ldy + i * 16,
                       V == INTS ? _mm512_cvtepi32_ps(iacc[i][r]) : facc[i][r]);
}

template <Variant V>
double top_per_s(int K, int N, int M) {
  constexpr int NT = 2, MT = 6;
  const int G = K / 32, tiles = N / 16;
  std::vector<uint8_t> w(size_t(tiles) * G * Q4_BLOCK);
  for (auto& x : w) x = uint8_t(rand());
  const uint16_t scale = 0x2000;  // fp16 d and m of every block: finite values
  for (size_t blk = 0; blk < w.size() / Q4_BLOCK; ++blk)
    for (int f = 0; f < 32; ++f) std::memcpy(&w[blk * Q4_BLOCK + 2 * f], &scale, 2);
  std::vector<int8_t> qx(size_t(M) * K);
  for (auto& x : qx) x = int8_t(rand() % 200 - 100);
  std::vector<float> dx(M * G, 1.0f), cx(M * G, 0.5f), y(size_t(M) * N);
  double best = 1e9;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int m0 = 0; m0 < M; m0 += MT)
      for (int t = 0; t < tiles; t += NT) {
        const uint8_t* wt[NT];
        for (int i = 0; i < NT; ++i) wt[i] = w.data() + size_t(t + i) * G * Q4_BLOCK;
        tile<NT, MT, V>(wt, G, qx.data() + size_t(m0) * K, dx.data() + m0 * G,
                        cx.data() + m0 * G, K, y.data() + size_t(m0) * N + t * 16, N);
      }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  return 2.0 * M * N * K / best / 1e12;
}

}  // namespace

int main() {
  const int K = 576, N = 1536, M = 264;
  std::printf("q4_1 x q8_1  %.3f TOP/s\n", top_per_s<Q4_1>(K, N, M));
  std::printf("ints only    %.3f\n", top_per_s<INTS>(K, N, M));
  std::printf("no d*dx mul  %.3f\n", top_per_s<NO_MUL>(K, N, M));
  std::printf("pow2 shift   %.3f\n", top_per_s<POW2_SHIFT>(K, N, M));
  std::printf("pow2 expadd  %.3f\n", top_per_s<POW2_EXPADD>(K, N, M));
  std::printf("one fma      %.3f\n", top_per_s<ONE_FMA>(K, N, M));
}
