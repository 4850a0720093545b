// sgl_cpu::lora_sgmv_: the LoRA adapters of a pass's rows added to one projection's output, each
// row with its own adapter (the segmented gather matrix-vector product of Punica, Chen et al.
// 2023, "Punica: Multi-Tenant LoRA Serving", section 4: shrink then expand per row).
//
// For row t with slot s = slots[t] >= 0 (rows with -1 are left as they are):
//   shrink: h = A_s x_t, A_s the rows [s * N, (s + 1) * N) of a (N = parts * R)
//   expand: for each part k, y_t[off_k : off_k + rows_k] += sum_r h[k * R + r] * bt_k[s * R + r]
// in float32, y rounded once at the end (to bfloat16 when y is). The masked dense matmuls of
// server/model/lora.py compute every row against every slot in the pass; here a row reads only
// its own adapter's factors, so a decode step reads each adapter once (rows are taken in slot
// order, each thread a contiguous run of them: an adapter's factors stay in its cache).
// Every row is computed alone: its values do not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace sgl_cpu {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i w[i] * x[i] over K (x already float32)
template <typename T>
inline float dot(const T* w, const float* x, int64_t K) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= K; i += 32)
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm256_fmadd_ps(load8(w + i + 8 * u), _mm256_loadu_ps(x + i + 8 * u), acc[u]);
  for (; i + 8 <= K; i += 8) acc[0] = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), acc[0]);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; i < K; ++i) s += load1(w + i) * x[i];
  return s;
}

// acc[j] += c * b[j] for j < n
template <typename T>
inline void axpy(float* acc, float c, const T* b, int64_t n) {
  const __m256 vc = _mm256_set1_ps(c);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(vc, load8(b + j), _mm256_loadu_ps(acc + j)));
  for (; j < n; ++j) acc[j] += c * load1(b + j);
}

template <typename T>
void sgmv(at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
          const std::vector<at::Tensor>& bt, int64_t R) {
  const int64_t rows_total = x.size(0), K = x.size(1), P = bt.size(), N = P * R;
  const int64_t width = y.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> order;
  for (int64_t t = 0; t < rows_total; ++t)
    if (slot[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t u, int64_t v) { return slot[u] < slot[v]; });
  std::vector<const T*> bp;
  std::vector<int64_t> rows;
  int64_t widest = 0;
  for (const at::Tensor& b : bt) {
    bp.push_back(b.data_ptr<T>());
    rows.push_back(b.size(1));
    widest = std::max(widest, b.size(1));
  }
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> xf(K), h(N), acc(widest);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = order[i], s = slot[t];
      for (int64_t k = 0; k < K; ++k) xf[k] = load1(xp + t * K + k);
      for (int64_t n = 0; n < N; ++n) h[n] = dot(ap + (s * N + n) * K, xf.data(), K);
      int64_t col = 0;
      for (int64_t k = 0; k < P; ++k) {
        std::fill(acc.begin(), acc.begin() + rows[k], 0.f);
        for (int64_t r = 0; r < R; ++r)
          axpy(acc.data(), h[k * R + r], bp[k] + (s * R + r) * rows[k], rows[k]);
        T* out = yp + t * width + col;
        for (int64_t j = 0; j < rows[k]; ++j) out[j] = static_cast<T>(load1(out + j) + acc[j]);
        col += rows[k];
      }
    }
  });
}

}  // namespace

// y [T, sum rows_k] (float32 or bfloat16, contiguous; updated in place); x [T, K], a
// [slots * P * R, K] and each bt[k] [slots * R, rows_k] of y's dtype, contiguous; slots [T]
// int64 (-1: no adapter); rank R.
void lora_sgmv_(at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
                const std::vector<at::Tensor>& bt, int64_t rank) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && a.dim() == 2 && y.size(0) == x.size(0) &&
                  a.size(1) == x.size(1) && slots.numel() == x.size(0),
              "lora_sgmv_: y [T, out], x [T, K], a [S * P * R, K], slots [T]");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() &&
                  slots.is_contiguous() && slots.scalar_type() == at::kLong,
              "lora_sgmv_: contiguous tensors, int64 slots");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "lora_sgmv_: y, x and the factors all float32 or all bfloat16");
  int64_t width = 0;
  for (const at::Tensor& b : bt) {
    TORCH_CHECK(b.dim() == 2 && b.is_contiguous() && b.scalar_type() == y.scalar_type() &&
                    b.size(0) * static_cast<int64_t>(bt.size()) == a.size(0) &&
                    b.size(0) % rank == 0,
                "lora_sgmv_: bt[k] [S * R, rows_k], contiguous, y's dtype");
    width += b.size(1);
  }
  TORCH_CHECK(width == y.size(1), "lora_sgmv_: the parts' rows must add up to y's width");
  if (y.scalar_type() == at::kFloat) sgmv<float>(y, x, slots, a, bt, rank);
  else sgmv<c10::BFloat16>(y, x, slots, a, bt, rank);
}

}  // namespace sgl_cpu

TORCH_LIBRARY_FRAGMENT(sgl_cpu, m) {
  m.def("lora_sgmv_(Tensor(a!) y, Tensor x, Tensor slots, Tensor a, Tensor[] bt, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_cpu, CPU, m) {
  m.impl("lora_sgmv_", [](at::Tensor& y, const at::Tensor& x, const at::Tensor& slots,
                          const at::Tensor& a, at::TensorList bt, int64_t rank) {
    sgl_cpu::lora_sgmv_(y, x, slots, a, bt.vec(), rank);
  });
}
