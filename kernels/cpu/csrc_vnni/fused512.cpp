// sgl_cpu_vnni::silu_mul: silu(gate) * up on 16 lanes (the AVX2 op: sgl_cpu::silu_mul in
// ../csrc/fused.cpp), for the CPU classes whose attention runs in this library.
//   gate_up [T, 2 I] float32/bfloat16 (the halves) -> [T, I] in its dtype, by
//   sgl_cpu::silu_times (vec512.h). Rows are independent and computed the same whatever the
//   batch.
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
  for (int64_t t = T0; t < T1; ++t) {
    const T* gt = g + t * 2 * I;
    T* ot = o + t * I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = sgl_cpu::lanes(I - i);
      sgl_cpu::store16(ot + i, sgl_cpu::silu_times<T>(load16(gt + i, m), load16(gt + I + i, m)), m);
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
