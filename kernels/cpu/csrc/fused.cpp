// Fused elementwise ops of a decoder layer (one pass over the rows instead of 5-10 ATen ops):
//   rms_norm(x, w, eps)                    -> y = w * x / rms(x)                (HF LlamaRMSNorm)
//   add_rms_norm(x, residual, w, eps)      -> residual += x; y = rms_norm(residual)   (in place)
//   rope_store(qkv, cos, sin, ..., k_buf, v_buf, loc) -> RoPE on q and k inside qkv (in place,
//       HF's half-split rotate_half layout) and k, v written to the pool slots `loc`
//   silu_mul(gate_up) -> silu(gate) * up
// Rows are independent (and computed the same whatever the batch), float32 math, inputs and
// outputs float32 or bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>

#include <cmath>

#include "fused_checks.h"
#include "vec.h"

// float32 and bfloat16 only (the vector loads and stores of vec.h)
#define SGL_DISPATCH_FLOAT_BF16(TYPE, NAME, ...)                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace sgl_cpu {
namespace {

template <typename T>
inline float f(T v) { return static_cast<float>(v); }

template <typename T>
void norm_row(const T* x, const T* w, int64_t H, float eps, T* y) {
  // sum of squares: 8 lanes fed in order, then summed in one fixed order (hsum); a row's
  // result never depends on the batch
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; i < H; ++i) ss += f(x[i]) * f(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  // HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype): normalized value rounded to T first
  const __m256 vinv = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= H; i += 8)
    store8(y + i, _mm256_mul_ps(load8(w + i), round_to<T>(_mm256_mul_ps(load8(x + i), vinv))));
  for (; i < H; ++i) y[i] = static_cast<T>(f(w[i]) * f(static_cast<T>(f(x[i]) * inv)));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  const auto wc = w.contiguous();
  SGL_DISPATCH_FLOAT_BF16(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        norm_row(xp + t * H, wc.data_ptr<scalar_t>(), H, static_cast<float>(eps), yp + t * H);
    });
  });
  return y;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                        double eps) {
  check_rows(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == x.scalar_type(), "residual must be like x");
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  const auto wc = w.contiguous();
  SGL_DISPATCH_FLOAT_BF16(x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        scalar_t* r = rp + t * H;
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) store8(r + i, _mm256_add_ps(load8(r + i), load8(xp + t * H + i)));
        for (; i < H; ++i) r[i] = static_cast<scalar_t>(f(r[i]) + f(xp[t * H + i]));
        norm_row(r, wc.data_ptr<scalar_t>(), H, static_cast<float>(eps), yp + t * H);
      }
    });
  });
  return y;
}

// qkv [T, (Hq + 2 Hkv) * D] (q heads, then k heads, then v heads); cos, sin [T, D] in qkv's
// dtype; k_buf, v_buf [C, Hkv, D] in qkv's dtype, float32 or bfloat16; loc [T] int64. Rotates
// q and k in place; returns nothing.
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
                int64_t num_kv, int64_t head_dim, at::Tensor& k_buf, at::Tensor& v_buf,
                const at::Tensor& loc) {
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2;
  const auto lc = check_rope_store(qkv, cos, sin, num_q, num_kv, head_dim, k_buf, v_buf, loc);
  const int64_t* lp = lc.data_ptr<int64_t>();
  SGL_DISPATCH_FLOAT_BF16(qkv.scalar_type(), "rope_store", [&] {
    scalar_t* p = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    // K/V go to the pool as they are, or rounded to it (float32 -> bfloat16: nearest even,
    // as Tensor.to) or widened (bfloat16 -> float32, exact) when its dtype differs
    const auto kv_type = k_buf.scalar_type();
    // one head row of D at a time: the pool may be a head-major view (strides from the tensor)
    const int64_t slot_stride = k_buf.stride(0), head_stride = k_buf.stride(1);
    auto store = [&](const scalar_t* src, at::Tensor& buf, int64_t slot) {
      for (int64_t h = 0; h < num_kv; ++h, src += D) {
        const int64_t off = slot * slot_stride + h * head_stride;
        if (kv_type == qkv.scalar_type()) {
          std::copy(src, src + D, buf.data_ptr<scalar_t>() + off);
        } else if (kv_type == at::kBFloat16) {
          c10::BFloat16* dst = buf.data_ptr<c10::BFloat16>() + off;
          int64_t i = 0;
          for (; i + 8 <= D; i += 8) store8(dst + i, load8(src + i));
          for (; i < D; ++i) dst[i] = static_cast<c10::BFloat16>(f(src[i]));
        } else {
          float* dst = buf.data_ptr<float>() + off;
          for (int64_t i = 0; i < D; ++i) dst[i] = f(src[i]);
        }
      }
    };
    const int64_t width = (num_q + 2 * num_kv) * D;
    at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        scalar_t* row = p + t * width;
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        // HF: x * cos + rotate_half(x) * sin, each product rounded to the dtype, then summed
        for (int64_t h = 0; h < num_q + num_kv; ++h) {
          scalar_t* x = row + h * D;
          int64_t i = 0;
          for (; i + 8 <= half; i += 8) {  // the scalar loop's operations, 8 lanes at a time
            const __m256 a = load8(x + i), b = load8(x + i + half);
            const __m256 a_cos = round_to<scalar_t>(_mm256_mul_ps(a, load8(c + i)));
            const __m256 nb_sin = round_to<scalar_t>(
                _mm256_mul_ps(_mm256_xor_ps(b, _mm256_set1_ps(-0.0f)), load8(s + i)));
            const __m256 b_cos = round_to<scalar_t>(_mm256_mul_ps(b, load8(c + i + half)));
            const __m256 a_sin = round_to<scalar_t>(_mm256_mul_ps(a, load8(s + i + half)));
            store8(x + i, _mm256_add_ps(a_cos, nb_sin));
            store8(x + i + half, _mm256_add_ps(b_cos, a_sin));
          }
          for (; i < half; ++i) {
            const scalar_t a = x[i], b = x[i + half];
            const scalar_t a_cos = static_cast<scalar_t>(f(a) * f(c[i]));
            const scalar_t nb_sin = static_cast<scalar_t>(-f(b) * f(s[i]));
            const scalar_t b_cos = static_cast<scalar_t>(f(b) * f(c[i + half]));
            const scalar_t a_sin = static_cast<scalar_t>(f(a) * f(s[i + half]));
            x[i] = static_cast<scalar_t>(f(a_cos) + f(nb_sin));
            x[i + half] = static_cast<scalar_t>(f(b_cos) + f(a_sin));
          }
        }
        store(row + num_q * D, k_buf, lp[t]);
        store(row + (num_q + num_kv) * D, v_buf, lp[t]);
      }
    });
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2 I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  SGL_DISPATCH_FLOAT_BF16(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const scalar_t* gt = g + t * 2 * I;
        scalar_t* ot = o + t * I;
        int64_t i = 0;
        // silu(x) = x / (1 + exp(-x)); torch rounds it to the dtype before the product
        for (; i + 8 <= I; i += 8) {
          const __m256 x = load8(gt + i);
          const __m256 e = exp256(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
          const __m256 sx = round_to<scalar_t>(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
          store8(ot + i, _mm256_mul_ps(sx, load8(gt + I + i)));
        }
        if (i < I) {  // the tail, through a buffer of 8
          alignas(32) float buf[8] = {0};
          const int64_t n = I - i;
          for (int64_t j = 0; j < n; ++j) buf[j] = -f(gt[i + j]);
          _mm256_store_ps(buf, exp256(_mm256_load_ps(buf)));
          for (int64_t j = 0; j < n; ++j) {
            const float x = f(gt[i + j]);
            const scalar_t sx = static_cast<scalar_t>(x / (1.0f + buf[j]));
            ot[i + j] = static_cast<scalar_t>(f(sx) * f(gt[I + i + j]));
          }
        }
      }
    });
  });
  return out;
}

}  // namespace sgl_cpu
