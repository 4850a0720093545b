// The decoder layer's elementwise ops on 16 lanes, for the CPU classes whose attention runs in
// this library (the AVX2 ops: ../csrc/fused.cpp):
//   silu_mul(gate_up [T, 2 I]) -> silu(gate) * up [T, I], by sgl_cpu::silu_times (vec512.h);
//   rms_norm(x [T, H], w [H], eps) -> w * (x / rms(x)) rounded as HF's LlamaRMSNorm;
//   add_rms_norm(x, residual, w, eps): residual += x (in place), then rms_norm(residual);
//   rope_store(qkv, cos, sin, ...): RoPE on q and k inside qkv in place and k, v into the
//       pool slots, each product rounded before the sum as HF's apply_rope in torch computes
//       it (bitwise; the AVX2 op's float32 sums may be contracted into FMAs).
// float32 or bfloat16 in and out, float32 math. Rows are independent and computed the same
// whatever the batch: a row's sum of squares is fed in order into two 16-lane accumulators
// (elements 32 j + l and 32 j + 16 + l) and reduced in one fixed order. That order differs
// from the AVX2 op's 8 lanes, so the two libraries' norms may differ in the last bit; every
// path of one CPU class (the native decoder stack, the per-op model, CPUAttention) calls the
// same one.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../csrc/fused_checks.h"
#include "vec512.h"

#include <cmath>
#include <type_traits>

namespace sgl_cpu_vnni {
namespace {

template <typename T>
void silu_mul_rows(const T* g, T* o, int64_t T0, int64_t T1, int64_t I) {
  using sgl_cpu::load16;
  for (int64_t t = T0; t < T1; ++t) {
    const T* gt = g + t * 2 * I;
    T* ot = o + t * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = sgl_cpu::lanes(I - i);
      sgl_cpu::store16(ot + i, sgl_cpu::silu_times<T>(load16(gt + i, m), load16(gt + I + i, m)), m);
    }
  }
}

// NATIVE: bf16 roundings by the CPU's conversion (sgl_cpu::bf16_native; the same bits for normal
// values, sgl_cpu::native_bf16_rounding decides), here and in add_rms_norm and rope_store
template <typename T, bool NATIVE>
void norm_row(const T* x, const T* w, int64_t H, float eps, T* y) {
  using sgl_cpu::lanes;
  using sgl_cpu::load16;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= H; i += 32) {
    const __m512 a = load16(x + i), b = load16(x + i + 16);
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  if (i < H) {  // up to 31 more: masked lanes load 0 and add nothing
    const __m512 a = load16(x + i, lanes(H - i)), b = load16(x + i + 16, lanes(H - i - 16));
    acc0 = _mm512_fmadd_ps(a, a, acc0);
    acc1 = _mm512_fmadd_ps(b, b, acc1);
  }
  const float ss = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(H) + eps));
  // HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype): the normalized value rounded to T first
  for (i = 0; i < H; i += 16) {
    const __mmask16 m = lanes(H - i);
    const __m512 normed = sgl_cpu::round_to<T, NATIVE>(_mm512_mul_ps(load16(x + i, m), inv));
    sgl_cpu::store16_as<NATIVE>(y + i, _mm512_mul_ps(load16(w + i, m), normed), m);
  }
}

// f(pointer of x's dtype, the same for out, native) for float32 or bfloat16 tensors, native
// a std::bool_constant: whether bf16 rounds by the CPU's conversion
template <typename F>
void with_rows(const at::Tensor& x, at::Tensor& out, F&& f) {
  if (x.scalar_type() == at::kFloat) f(x.data_ptr<float>(), out.data_ptr<float>(), std::false_type{});
  else if (sgl_cpu::native_bf16_rounding())
    f(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), std::true_type{});
  else f(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), std::false_type{});
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  sgl_cpu::check_rows(x, w);
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  const auto wc = w.contiguous();
  with_rows(x, y, [&](auto* xp, auto* yp, auto native) {
    using T_ = std::remove_pointer_t<decltype(xp)>;
    const T_* wp = wc.data_ptr<T_>();
    at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        norm_row<T_, decltype(native)::value>(xp + t * H, wp, H, static_cast<float>(eps), yp + t * H);
    });
  });
  return y;
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                        double eps) {
  sgl_cpu::check_rows(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == x.scalar_type(), "residual must be like x");
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  const auto wc = w.contiguous();
  with_rows(residual, y, [&](auto* rp, auto* yp, auto native) {
    constexpr bool NATIVE = decltype(native)::value;
    using T_ = std::remove_pointer_t<decltype(rp)>;
    const T_* xp = x.data_ptr<T_>();
    const T_* wp = wc.data_ptr<T_>();
    at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        T_* r = rp + t * H;
        for (int64_t i = 0; i < H; i += 16) {  // the sum rounded to T, as the AVX2 op
          const __mmask16 m = sgl_cpu::lanes(H - i);
          sgl_cpu::store16_as<NATIVE>(r + i, _mm512_add_ps(sgl_cpu::load16(r + i, m),
                                                           sgl_cpu::load16(xp + t * H + i, m)), m);
        }
        norm_row<T_, NATIVE>(r, wp, H, static_cast<float>(eps), yp + t * H);
      }
    });
  });
  return y;
}

// As sgl_cpu::rope_store (../csrc/fused.cpp, whose checks it shares): qkv [T, (num_q + 2
// num_kv) * head_dim]; cos, sin [T, head_dim] in qkv's dtype; k_buf, v_buf [C, num_kv,
// head_dim] float32 or bfloat16; loc [T] int64.
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
                int64_t num_kv, int64_t head_dim, at::Tensor& k_buf, at::Tensor& v_buf,
                const at::Tensor& loc) {
  const auto lc =
      sgl_cpu::check_rope_store(qkv, cos, sin, num_q, num_kv, head_dim, k_buf, v_buf, loc);
  const int64_t T = qkv.size(0), D = head_dim, half = D / 2, width = (num_q + 2 * num_kv) * D;
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t slot_stride = k_buf.stride(0), head_stride = k_buf.stride(1);
  auto run = [&](auto* p, auto* kp, auto* vp, auto native) {
    using T_ = std::remove_pointer_t<decltype(p)>;
    using KV = std::remove_pointer_t<decltype(kp)>;
    constexpr bool NATIVE = decltype(native)::value;
    using sgl_cpu::load16;
    using sgl_cpu::round_to;
    const T_* cp = reinterpret_cast<const T_*>(cos.data_ptr());
    const T_* sp = reinterpret_cast<const T_*>(sin.data_ptr());
    const __m512 neg = _mm512_set1_ps(-0.0f);
    // each product rounded on its own, as torch's mul then add (the plain intrinsics may be
    // contracted into an FMA by the compiler: float32 results then differed from torch's)
    auto mul = [](__m512 x, __m512 y) {
      return _mm512_mul_round_ps(x, y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    };
    at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        T_* row = p + t * width;
        const T_* c = cp + t * D;
        const T_* s = sp + t * D;
        // HF: x * cos + rotate_half(x) * sin, each product rounded to the dtype, then summed
        for (int64_t h = 0; h < num_q + num_kv; ++h) {
          T_* x = row + h * D;
          for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = sgl_cpu::lanes(half - i);
            const __m512 a = load16(x + i, m), b = load16(x + i + half, m);
            const __m512 a_cos = round_to<T_, NATIVE>(mul(a, load16(c + i, m)));
            const __m512 nb_sin = round_to<T_, NATIVE>(mul(_mm512_xor_ps(b, neg), load16(s + i, m)));
            const __m512 b_cos = round_to<T_, NATIVE>(mul(b, load16(c + i + half, m)));
            const __m512 a_sin = round_to<T_, NATIVE>(mul(a, load16(s + i + half, m)));
            sgl_cpu::store16_as<NATIVE>(x + i, _mm512_add_ps(a_cos, nb_sin), m);
            sgl_cpu::store16_as<NATIVE>(x + i + half, _mm512_add_ps(b_cos, a_sin), m);
          }
        }
        // K and V to the pool, a head row at a time (the pool may be a head-major view): as
        // they are, rounded to nearest even or widened (exact)
        for (int which = 0; which < 2; ++which)
          for (int64_t h = 0; h < num_kv; ++h) {
            const T_* src = row + (num_q + which * num_kv + h) * D;
            KV* dst = (which ? vp : kp) + lp[t] * slot_stride + h * head_stride;
            for (int64_t i = 0; i < D; i += 16) {
              const __mmask16 m = sgl_cpu::lanes(D - i);
              sgl_cpu::store16(dst + i, load16(src + i, m), m);
            }
          }
      }
    });
  };
  auto with_kv = [&](auto* p, auto native) {
    if (k_buf.scalar_type() == at::kFloat) run(p, k_buf.data_ptr<float>(), v_buf.data_ptr<float>(), native);
    else run(p, k_buf.data_ptr<c10::BFloat16>(), v_buf.data_ptr<c10::BFloat16>(), native);
  };
  if (qkv.scalar_type() == at::kFloat) with_kv(qkv.data_ptr<float>(), std::false_type{});
  else if (sgl_cpu::native_bf16_rounding()) with_kv(qkv.data_ptr<c10::BFloat16>(), std::true_type{});
  else with_kv(qkv.data_ptr<c10::BFloat16>(), std::false_type{});
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2 I] tensor");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16,
              "gate_up must be float32 or bfloat16");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  auto run = [&](auto* g, auto* o) {
    at::parallel_for(0, T, 16, [&](int64_t lo, int64_t hi) { silu_mul_rows(g, o, lo, hi, I); });
  };
  if (gate_up.scalar_type() == at::kFloat) run(gate_up.data_ptr<float>(), out.data_ptr<float>());
  else run(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY_FRAGMENT(sgl_cpu_vnni, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_q, int num_kv, "
        "int head_dim, Tensor(b!) k_buf, Tensor(c!) v_buf, Tensor loc) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) {
  m.impl("silu_mul", &sgl_cpu_vnni::silu_mul);
  m.impl("rms_norm", &sgl_cpu_vnni::rms_norm);
  m.impl("add_rms_norm", &sgl_cpu_vnni::add_rms_norm);
  m.impl("rope_store", &sgl_cpu_vnni::rope_store);
}
