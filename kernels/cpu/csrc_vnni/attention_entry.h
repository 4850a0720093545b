// The entry points of the bf16 chunk kernels (attention_bf16.cpp, attention_amx.cpp): bfloat16
// q and K/V with head_dim % 32 == 0 run on the kernel's chunk, anything else on the float32
// AVX-512 one (attention512.cpp); each op has sgl_cpu::attention's schema and contract.
#pragma once

#include <ATen/ATen.h>

#include "../csrc/attention_impl.h"

// the schema of an attention op named `name` (a string literal)
#define SGL_ATTENTION_SCHEMA(name)                                                              \
  name "(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor req_rows, "          \
       "Tensor prefix_lens, Tensor extend_lens, float scale, int window, float softcap) -> Tensor"

namespace sgl_cpu_vnni {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& req_rows,
                     const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                     int64_t window, double softcap);

template <typename Chunk>
at::Tensor attention_on_bf16_chunk(const at::Tensor& q, const at::Tensor& k_buf,
                                   const at::Tensor& v_buf, const at::Tensor& req_to_token,
                                   const at::Tensor& req_rows, const at::Tensor& prefix_lens,
                                   const at::Tensor& extend_lens, double scale, int64_t window,
                                   double softcap) {
  if (q.scalar_type() != at::kBFloat16 || k_buf.scalar_type() != at::kBFloat16 ||
      q.dim() != 3 || q.size(2) % 32 != 0)
    return attention(q, k_buf, v_buf, req_to_token, req_rows, prefix_lens, extend_lens, scale,
                     window, softcap);
  return sgl_cpu::attention_forward<Chunk>(q, k_buf, v_buf, req_to_token, req_rows, prefix_lens,
                                           extend_lens, scale, window, softcap);
}

}  // namespace sgl_cpu_vnni
