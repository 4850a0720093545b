// The VNNI linear layers' weight packers (sgl_cpu_vnni::pack_int4 / pack_int8): run once at
// load, they write a quantized weight in the layout vnni_linear.cpp computes with
// (packed_layout.h). Compiled into the VNNI library (kernels/cpu/build.py); the packers use
// no AVX-512 themselves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../csrc/linear_inputs.h"
#include "packed_layout.h"

#include <cstring>

namespace sgl_cpu_vnni {

// q [N, K] uint8 in [0, 15], scale/zero [N, K / 32] float32 with w = (q - 8) * scale + zero
// -> [ceil(N / 16), K / 32 * 320] uint8 (packed_layout.h's int4 layout; d = fp16(scale),
// m = fp16(zero - 8 * scale), as sgl_cpu::pack_int4).
at::Tensor pack_int4(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero) {
  const sgl_cpu::Int4Source src = sgl_cpu::int4_source(q, scale, zero);
  const int64_t N = src.N, G = src.G, tiles = (N + TILE - 1) / TILE;
  auto out = at::zeros({tiles, G * Q4_BLOCK}, q.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* b = op + (t * G + g) * Q4_BLOCK;
        for (int64_t f = 0; f < TILE && t * TILE + f < N; ++f) {
          const auto [hd, hm] = src.dm(t * TILE + f, g);
          std::memcpy(b + 2 * f, &hd, 2);
          std::memcpy(b + 32 + 2 * f, &hm, 2);
          const uint8_t* w = src.row(t * TILE + f, g);
          for (int c = 0; c < 4; ++c)
            for (int j = 0; j < 4; ++j)
              b[64 + 64 * c + 4 * f + j] =
                  (w[8 * c + j] & 0x0F) | ((w[8 * c + 4 + j] & 0x0F) << 4);
        }
      }
    }
  });
  return out;
}

// w [N, K] int8 -> [ceil(N / 16), K / 32 * 512] uint8 (packed_layout.h's int8 layout, u = w + 128).
at::Tensor pack_int8(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "w must be [N, K] int8");
  const int64_t N = w.size(0), K = w.size(1), G = K / QK, tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of ", QK);
  auto wc = w.contiguous();
  auto out = at::full({tiles, G * Q8_BLOCK}, 128, w.options().dtype(at::kByte));
  const int8_t* wp = wc.data_ptr<int8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* b = op + (t * G + g) * Q8_BLOCK;
        for (int64_t f = 0; f < TILE && t * TILE + f < N; ++f) {
          const int8_t* src = wp + (t * TILE + f) * K + g * QK;
          for (int c = 0; c < 8; ++c)
            for (int j = 0; j < 4; ++j)
              b[64 * c + 4 * f + j] = static_cast<uint8_t>(src[4 * c + j] + 128);
        }
      }
  });
  return out;
}

}  // namespace sgl_cpu_vnni

TORCH_LIBRARY_IMPL(sgl_cpu_vnni, CPU, m) {
  m.impl("pack_int4", &sgl_cpu_vnni::pack_int4);
  m.impl("pack_int8", &sgl_cpu_vnni::pack_int8);
}
