// The sgl_cpu operator library: schemas and CPU implementations (kernels/cpu/__init__.py loads
// it; kernels/cpu/build.py compiles it at install time).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(sgl_cpu, m) {
  m.def("pack_int4(Tensor q, Tensor scale, Tensor zero) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, int N) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor req_rows, "
        "Tensor prefix_lens, Tensor extend_lens, float scale, int window, float softcap) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor w, float eps) -> Tensor");
  m.def("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_q, int num_kv, int head_dim, "
        "Tensor(b!) k_buf, Tensor(c!) v_buf, Tensor loc) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_cpu, CPU, m) {
  m.impl("pack_int4", &sgl_cpu::pack_int4);
  m.impl("int4_linear", &sgl_cpu::int4_linear);
  m.impl("int8_linear", &sgl_cpu::int8_linear);
  m.impl("attention", &sgl_cpu::attention);
  m.impl("rms_norm", &sgl_cpu::rms_norm);
  m.impl("add_rms_norm", &sgl_cpu::add_rms_norm);
  m.impl("rope_store", &sgl_cpu::rope_store);
  m.impl("silu_mul", &sgl_cpu::silu_mul);
}
