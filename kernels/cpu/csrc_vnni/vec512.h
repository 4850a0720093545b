// AVX-512 helpers shared by the sgl_cpu_vnni kernels: 16-lane float32 loads and stores from
// float32 or bfloat16 memory (masked for tails), bfloat16 rounding in registers, and exp.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace sgl_cpu {

inline __m512 load16(const float* p, __mmask16 m = 0xFFFF) {
  return m == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 m = 0xFFFF) {
  const __m256i h = m == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the lanes of the first `n` (0 .. 16, clamped) of 16 floats
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// exp(x) on 16 lanes: x = n ln 2 + r (n = round(x / ln 2), ln 2 in two parts, |r| <= ln 2 / 2),
// exp(r) by Cephes' expf polynomial (as vec.h's exp256), scaled by 2^n with vscalefps;
// relative error ~1e-7; x < -87.3 (so -inf) and NaN give 0, large x gives inf.
inline __m512 exp512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

// 2^x on 16 lanes: x = n + r (n = round(x), |r| <= 1 / 2), 2^r by a degree-5 polynomial
// (Horner; coefficients fitted for relative error on [-1/2, 1/2], 2.4e-7 in float32),
// scaled by 2^n with vscalefps; x < -126 (so -inf) and NaN give 0. For softmax scores
// already in base 2 (log2(e) folded into their scale): 9 operations where exp512 takes 15.
inline __m512 exp2_512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.327650505118072e-3f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.675541892647743e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.550713092088699e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.4022120237350464e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.931469440460205e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0000001192092896f));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

// The bits of bfloat16(v) in the high half of each lane (low half zero): round to nearest
// even, NaN -> 0x7FC0, exactly as c10::BFloat16(float).
inline __m512i bf16_bits_hi(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)),
      _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC00000));
}

inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) {
  if (m == 0xFFFF) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, m, v);
}
// float32 -> bfloat16, rounded as c10::BFloat16(float)
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits_hi(v), 16));
  if (m == 0xFFFF) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  else _mm256_mask_storeu_epi16(p, m, h);
}

// bfloat16(v) by the CPU's AVX512-BF16 conversion, vcvtneps2bf16 (inline assembly: this
// library is compiled without -mavx512bf16, so call it only where the CPU has AVX512-BF16, see
// native_bf16_rounding): round to nearest even, c10::BFloat16's bits for every normal value
// and zero, but denormals flush to zero and a NaN keeps its payload (c10 keeps denormals and
// gives 0x7FC0). One instruction where bf16_bits_hi takes seven: the fused gate/up linear's
// four roundings a vector made it 4% slower at prefill (1,030 rows, Zen 5).
inline __m256i bf16_native(__m512 v) {
  __m256i h;
  asm("vcvtneps2bf16 %1, %0" : "=v"(h) : "v"(v));
  return h;
}

// Whether bf16 rounding runs on the CPU's conversion (bf16_native) in the kernels that offer
// it (the fused gate/up SiLU tile, the norms, RoPE): the CPU has AVX512-BF16 and SGL_CPU_ISA
// (kernels/cpu_features.py's override) names no lower class, so a test can run the emulated
// rounding on such a machine too. Decided once per process.
inline bool native_bf16_rounding() {
  static const bool on = [] {
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    const char* isa = std::getenv("SGL_CPU_ISA");
    return isa == nullptr || *isa == 0 || std::strcmp(isa, "avx512_bf16") == 0 ||
           std::strcmp(isa, "amx") == 0;
  }();
  return on;
}

// store16, rounding by bf16_native where NATIVE and T is bfloat16
template <bool NATIVE, typename T>
inline void store16_as(T* p, __m512 v, __mmask16 m = 0xFFFF) {
  if constexpr (NATIVE && std::is_same_v<T, c10::BFloat16>) {
    if (m == 0xFFFF) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_native(v));
    else _mm256_mask_storeu_epi16(p, m, bf16_native(v));
  } else {
    store16(p, v, m);
  }
}

// v rounded to T and back to float32 (what static_cast<float>(static_cast<T>(v)) gives;
// NATIVE: by bf16_native)
template <typename T, bool NATIVE = false>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (NATIVE) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_native(v)), 16));
  else return _mm512_castsi512_ps(bf16_bits_hi(v));
}

// reduce16(s, op): lane p = the op-reduction of the 16 lanes of s[SLOT_OF[p]], for 16 vectors
// s at once (float32 lanes, or int32 ones through casts; op is applied to whole vectors): 8 +
// 4 + 2 + 1 ops and shuffle pairs instead of 16 horizontal reductions, each a latency chain.
// Every vector's lanes are combined by the same tree ((l0 + l8) + (l4 + l12)) + ((l2 + l10) +
// (l6 + l14)) + (the same from l1), which is GCC's _mm512_reduce_add_ps order
// (avx512fintrin.h): float sums are bitwise that intrinsic's. SLOT_OF is its own inverse.
constexpr int SLOT_OF[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

template <typename Op>
inline __m512 reduce16(const __m512* s, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes i, i + 8
    a[i] = op(_mm512_shuffle_f32x4(s[i], s[i + 8], 0x44), _mm512_shuffle_f32x4(s[i], s[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit blocks 0, 1 and 2, 3
    b[i] = op(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i) {  // lanes 0, 2 and 1, 3 of each block
    const __m512d x = _mm512_castps_pd(b[i]), y = _mm512_castps_pd(b[i + 2]);
    c[i] = op(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));  // lanes 0, 1
}

// v's lanes in slot order: lane i of the result = lane SLOT_OF[i] of v (a reduce16 result
// back in the order of its vectors)
inline __m512 in_slot_order(__m512 v) {
  return _mm512_permutexvar_ps(_mm512_loadu_si512(SLOT_OF), v);
}

// silu(g) * u on 16 lanes, g and u values of T (already rounded to it): silu(g) = g / (1 +
// exp(-g)), the quotient by vrcp14ps and one Newton step (within ~2 ulp of the division),
// rounded to T before the product as torch rounds it; the caller's store rounds the product.
// sgl_cpu_vnni::silu_mul and the fused gate/up linear (vnni_linear.cpp) both compute it here.
template <typename T, bool NATIVE = false>
inline __m512 silu_times(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));  // r (2 - d r): Newton
  return _mm512_mul_ps(round_to<T, NATIVE>(_mm512_mul_ps(g, r)), u);
}

}  // namespace sgl_cpu
