// sgl_cpu_vnni::attention: the attention driver (../csrc/attention_impl.h) on the AVX-512 chunk
// kernel (attention_chunk512.h), the same contract as sgl_cpu::attention.
#include <torch/library.h>

#include "../csrc/attention_impl.h"
#include "attention_chunk512.h"

namespace sgl_cpu_vnni {

// Shapes and dtypes: sgl_cpu::attention_forward (../csrc/attention_impl.h).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& req_rows,
                     const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                     int64_t window, double softcap) {
  return sgl_cpu::attention_forward<sgl_cpu::Avx512Chunk>(
      q, k_buf, v_buf, req_to_token, req_rows, prefix_lens, extend_lens, scale, window, softcap);
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY_FRAGMENT(sgl_cpu_vnni, m) {
  m.def("attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor req_rows, "
        "Tensor prefix_lens, Tensor extend_lens, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) { m.impl("attention", &sgl_cpu_vnni::attention); }
