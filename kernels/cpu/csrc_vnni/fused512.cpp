// sgl_cpu_vnni::silu_mul: silu(gate) * up on 16 lanes (the AVX2 op: sgl_cpu::silu_mul in
// ../csrc/fused.cpp), for the CPU classes whose attention runs in this library.
//   gate_up [T, 2 I] float32/bfloat16 (the halves) -> [T, I] in its dtype; silu(x) = x / (1 +
//   exp(-x)), the quotient by vrcp14ps and one Newton step (within ~2 ulp of the division),
//   rounded to the dtype before the product as torch rounds it. Rows are independent and
//   computed the same whatever the batch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec512.h"

namespace sgl_cpu_vnni {
namespace {

template <typename T>
void silu_mul_rows(const T* g, T* o, int64_t T0, int64_t T1, int64_t I) {
  using sgl_cpu::load16;
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  for (int64_t t = T0; t < T1; ++t) {
    const T* gt = g + t * 2 * I;
    T* ot = o + t * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = sgl_cpu::lanes(I - i);
      const __m512 x = load16(gt + i, m);
      const __m512 d = _mm512_add_ps(one, sgl_cpu::exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
      __m512 r = _mm512_rcp14_ps(d);
      r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));  // r (2 - d r): one Newton step
      const __m512 sx = sgl_cpu::round_to<T>(_mm512_mul_ps(x, r));
      sgl_cpu::store16(ot + i, _mm512_mul_ps(sx, load16(gt + I + i, m)), m);
    }
  }
}

}  // namespace

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

TORCH_LIBRARY_FRAGMENT(sgl_cpu_vnni, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) { m.impl("silu_mul", &sgl_cpu_vnni::silu_mul); }
