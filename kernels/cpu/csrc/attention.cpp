// sgl_cpu::attention: the attention driver (attention_impl.h) on the AVX2 chunk kernel.
#include "attention_chunk.h"
#include "attention_impl.h"
#include "ops.h"

namespace sgl_cpu {

// Shapes and dtypes: attention_forward (attention_impl.h).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& req_rows,
                     const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                     int64_t window, double softcap) {
  return attention_forward<Avx2Chunk>(q, k_buf, v_buf, req_to_token, req_rows, prefix_lens,
                                      extend_lens, scale, window, softcap);
}

}  // namespace sgl_cpu
