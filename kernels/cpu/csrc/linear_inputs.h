// The inputs of both linear libraries' ops (sgl_cpu, sgl_cpu_vnni), checked: the activations
// x [M, K], and the int4 weight as server.model.quantization hands it to the packers: q [N, K]
// uint8 in [0, 15] and scale, zero [N, K / 32] with w = (q - 8) * scale + zero, made contiguous,
// with each block's fp16 pair (d, m), w = d * q + m (GGUF Q4_1's form). Internal linkage: the
// two libraries are compiled for different instruction sets and must not share symbols.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <utility>

namespace sgl_cpu {
namespace {

struct Int4Source {
  at::Tensor q, scale, zero;  // contiguous; scale and zero float32
  int64_t N, K, G;            // G = K / 32 blocks a row

  const uint8_t* row(int64_t n, int64_t g) const { return q.data_ptr<uint8_t>() + n * K + 32 * g; }
  // (fp16 d, fp16 m) of block g of row n
  std::pair<uint16_t, uint16_t> dm(int64_t n, int64_t g) const {
    const float d = scale.data_ptr<float>()[n * G + g], z = zero.data_ptr<float>()[n * G + g];
    return {_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT),
            _cvtss_sh(z - 8.0f * d, _MM_FROUND_TO_NEAREST_INT)};
  }
};

// Raises c10::Error (RuntimeError) for bad shapes or types.
inline Int4Source int4_source(const at::Tensor& q, const at::Tensor& scale,
                              const at::Tensor& zero) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "q must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), G = K / 32;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.sizes() == zero.sizes() && scale.dim() == 2 && scale.size(0) == N &&
              scale.size(1) == G, "scale and zero must be [N, K / 32]");
  return {q.contiguous(), scale.to(at::kFloat).contiguous(), zero.to(at::kFloat).contiguous(),
          N, K, G};
}

// x [M, K] float32/bfloat16, contiguous, on the CPU, K a multiple of `multiple`.
inline void check_x(const at::Tensor& x, int64_t K, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x must be a contiguous CPU tensor");
  TORCH_CHECK(K % multiple == 0, "in_features must be a multiple of ", multiple, ", got ", K);
}

}  // namespace
}  // namespace sgl_cpu
