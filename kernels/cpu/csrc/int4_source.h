// The int4 weight as server.model.quantization hands it to the packers of both linear
// libraries (sgl_cpu::pack_int4, sgl_cpu_vnni::pack_int4): q [N, K] uint8 in [0, 15] and
// scale, zero [N, K / 32] with w = (q - 8) * scale + zero, checked and made contiguous, and
// each block's fp16 pair (d, m) with w = d * q + m (GGUF Q4_1's form). Internal linkage: the
// two libraries are compiled for different instruction sets and must not share symbols.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>

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

}  // namespace
}  // namespace sgl_cpu
