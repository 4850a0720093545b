// The argument checks of the fused decoder-layer ops, shared by the AVX2 ops (fused.cpp) and
// the AVX-512 ones (../csrc_vnni/fused512.cpp), which live in separate libraries.
#pragma once

#include <ATen/ATen.h>

namespace sgl_cpu {

// x [T, H] contiguous, float32 or bfloat16; w [H] in x's dtype (RMSNorm's weight). Raises
// c10::Error naming the argument.
inline void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be [H] in x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
}

// qkv [T, (num_q + 2 num_kv) * head_dim] contiguous; cos, sin [T, head_dim] in qkv's dtype;
// k_buf, v_buf [C, num_kv, head_dim] with contiguous head rows and the same strides (the CPU
// pool is a view of head-major storage), float32 or bfloat16 (or qkv's dtype); loc
// [T] int64 slots inside the pool. Raises c10::Error naming the argument; returns loc made
// contiguous.
inline at::Tensor check_rope_store(const at::Tensor& qkv, const at::Tensor& cos,
                                   const at::Tensor& sin, int64_t num_q, int64_t num_kv,
                                   int64_t head_dim, const at::Tensor& k_buf,
                                   const at::Tensor& v_buf, const at::Tensor& loc) {
  const int64_t T = qkv.size(0), D = head_dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_q + 2 * num_kv) * D,
              "qkv must be a contiguous [T, (num_q + 2 num_kv) * head_dim] tensor");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "qkv must be float32 or bfloat16");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == D &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type(),
              "cos and sin must be contiguous [T, head_dim] in qkv's dtype");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type() &&
              (k_buf.scalar_type() == qkv.scalar_type() || k_buf.scalar_type() == at::kFloat ||
               k_buf.scalar_type() == at::kBFloat16) &&
              k_buf.stride(2) == 1 && k_buf.strides() == v_buf.strides() &&
              k_buf.size(1) == num_kv && k_buf.size(2) == D, "the KV buffers must be [C, "
              "num_kv, head_dim] with contiguous head rows and the same strides, both in qkv's "
              "dtype, float32 or bfloat16");
  TORCH_CHECK(loc.numel() == T && loc.scalar_type() == at::kLong, "loc must be [T] int64");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  auto lc = loc.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t C = k_buf.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(lp[t] >= 0 && lp[t] < C, "loc[", t, "] = ", lp[t], " is outside the pool");
  return lc;
}

}  // namespace sgl_cpu
