// The sgl_cpu operators' C++ entry points (ops.cpp registers them; decoder_stack.cpp calls
// them directly). Shapes and dtypes: each definition's comment.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace sgl_cpu {
at::Tensor pack_int4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);
at::Tensor attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& req_rows,
                     const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale,
                     int64_t window, double softcap);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w,
                        double eps);
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
                int64_t num_kv, int64_t head_dim, at::Tensor& k_buf, at::Tensor& v_buf,
                const at::Tensor& loc);
at::Tensor silu_mul(const at::Tensor& gate_up);
void lora_sgmv_(at::Tensor& y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a,
                const std::vector<at::Tensor>& bt, int64_t rank);
}  // namespace sgl_cpu
