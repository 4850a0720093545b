// sgl_cpu::DecoderStack: a Llama-family decoder stack's forward pass as one call from Python.
//
// The Python loop over layers issues ~10 ops a layer (norms, three quantized linears and their
// Python wrappers, RoPE + K/V store, attention, SiLU * up, the residual add): at batch 1 on the
// default model about a quarter of a decode step was Python and dispatch between the ops. This
// class holds the layers' packed weights and calls the same kernels in the same order from C++
// (the linear kernels through the dispatcher, by name, so either linear library serves), so a
// pass costs one Python call. Outputs are bitwise those of the Python loop
// (server/model/llama.py, DecoderLayer.forward with a fused backend), which stays the reference
// and serves every model this class does not take (see server/model/native_stack.py).
//
// The residual add that ends a layer is fused with the next layer's input RMSNorm
// (add_rms_norm: residual += out, then the norm of the sum): the same values as x + out
// followed by rms_norm(x), with one pass over the rows fewer.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ops.h"

#include <optional>
#include <vector>

namespace sgl_cpu {
namespace {

// Linear kernel codes (server/model/native_stack.py writes them): which op runs a QuantLinear.
enum LinearKind : int64_t { AVX2_INT4 = 0, AVX2_INT8 = 1, VNNI_INT4 = 2, VNNI_INT8 = 3 };

// Attention kernel codes (native_stack.py): sgl_cpu::attention, sgl_cpu_vnni::attention,
// sgl_cpu_vnni::attention_bf16, sgl_cpu_vnni::attention_amx.
enum AttentionKind : int64_t {
  AVX2_ATTENTION = 0, AVX512_ATTENTION = 1, BF16_ATTENTION = 2, AMX_ATTENTION = 3
};

using AttentionOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double, int64_t, double);
using SiluOp = at::Tensor(const at::Tensor&);
using NormOp = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNormOp = at::Tensor(const at::Tensor&, at::Tensor&, const at::Tensor&, double);
using RopeOp = void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                    at::Tensor&, at::Tensor&, const at::Tensor&);
using Int4Op = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using Int8Op = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Linear {
  int64_t kind, out_features;
  at::Tensor packed, scales, bias;  // bias: undefined when the layer has none
  int64_t amx_min_rows = 0;  // VNNI_INT4: passes of this many rows run on AMX tiles (0: never)

  // QuantLinear's choice: sgl_cpu_vnni::amx_int4_linear for long extends where it has AMX
  bool on_amx(const at::Tensor& x) const {
    return kind == VNNI_INT4 && amx_min_rows > 0 && x.size(0) >= amx_min_rows;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (on_amx(x)) {
      static const auto f = op<Int4Op>("sgl_cpu_vnni::amx_int4_linear");
      y = f.call(x, packed, out_features);
      return bias.defined() ? y + bias : y;
    }
    switch (kind) {
      case AVX2_INT4: {
        static const auto f = op<Int4Op>("sgl_cpu::int4_linear");
        y = f.call(x, packed, out_features);
        break;
      }
      case AVX2_INT8: {
        static const auto f = op<Int8Op>("sgl_cpu::int8_linear");
        y = f.call(x, packed, scales);
        break;
      }
      case VNNI_INT4: {
        static const auto f = op<Int4Op>("sgl_cpu_vnni::int4_linear");
        y = f.call(x, packed, out_features);
        break;
      }
      default: {
        static const auto f = op<Int8Op>("sgl_cpu_vnni::int8_linear");
        y = f.call(x, packed, scales);
      }
    }
    return bias.defined() ? y + bias : y;  // QuantLinear: y + bias.to(y.dtype)
  }
};

// The LoRA adapters of one pass (server/model/lora.py, LoraBatch.native_args): per layer, for
// qkv_proj, o_proj, gate_up_proj and down_proj, A then the B of each of its parts (q, k, v;
// o; gate, up; down) = 11 tensors a layer; slots [T] each row's slot (-1: none); rank R; mode:
//   SGMV: A [S * P * R, in] and B^T [S * R, rows_k] of every slot, run by lora_sgmv_;
//   PACKED / PLAIN: [out, in] weights, oneDNN-reordered (mkldnn::_linear_pointwise) or plain
//   (at::linear), of the slots the pass spans, masked by masks[P - 1] [T, n * P * R].
enum LoraMode : int64_t { LORA_PLAIN = 0, LORA_PACKED = 1, LORA_SGMV = 2 };

struct Lora {
  const std::vector<at::Tensor>& w;
  std::vector<at::Tensor> masks;
  at::Tensor slots;
  int64_t rank;
  int64_t mode;

  static constexpr int kParts[4] = {3, 1, 2, 1};
  static constexpr int kFirst[4] = {0, 4, 6, 9};  // A's index among a layer's 11

  at::Tensor linear(const at::Tensor& x, const at::Tensor& w) const {
    if (mode == LORA_PLAIN) return at::linear(x, w);
    static const auto f =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    f.callBoxed(&stack);
    return stack[0].toTensor();
  }

  // y + the adapters' addition to projection j of layer l, for its input x [T, in] and
  // output y [T, out] (updated in place in SGMV mode; LoraBatch.add_to's operations)
  at::Tensor add_to(size_t l, int j, const at::Tensor& x, at::Tensor y) const {
    RECORD_FUNCTION("sgl_cpu::lora_add", std::vector<c10::IValue>());
    const at::Tensor* t = &w[11 * l + kFirst[j]];
    const int parts = kParts[j];
    if (mode == LORA_SGMV) {
      lora_sgmv_(y, x.contiguous(), slots, t[0], std::vector<at::Tensor>(t + 1, t + 1 + parts),
                 rank);
      return y;
    }
    const at::Tensor h = linear(x.contiguous(), t[0]) * masks[parts - 1];
    if (parts == 1) return y + linear(h, t[1]);
    const int64_t T = x.size(0), n = h.size(1) / (parts * rank);
    const at::Tensor hv = h.view({T, n, parts, rank});
    std::vector<at::Tensor> outs;
    for (int k = 0; k < parts; ++k)
      outs.push_back(linear(hv.select(2, k).reshape({T, n * rank}), t[1 + k]));
    return y + at::cat(outs, 1);
  }
};

}  // namespace

// Built once from the model (server/model/native_stack.py); forward per pass.
//   tensors: per layer, in order: input_layernorm [H], post_attention_layernorm [H], then for
//       qkv_proj, o_proj, gate_up_proj, down_proj each: packed, scales, bias (a 0-element
//       tensor when none) = 14 tensors a layer; then the final norm [H].
//   ints: per layer: the four linears' (kind, out_features), then the sliding window
//       (0 = none) = 9 ints a layer; then num_q, num_kv, head_dim, the attention kernel
//       (AttentionKind) and the rows from which VNNI int4 linears run on AMX (0 = never).
//   k_buffers, v_buffers: the KV pool's per-layer buffers [capacity, num_kv, head_dim].
//   floats: rms_norm_eps, attention scale, attention-logit soft-cap (0 = none).
class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
               std::vector<at::Tensor> k_buffers, std::vector<at::Tensor> v_buffers,
               std::vector<double> floats)
      : k_(std::move(k_buffers)), v_(std::move(v_buffers)) {
    const size_t layers = k_.size();
    TORCH_CHECK(v_.size() == layers && tensors.size() == 14 * layers + 1 &&
                ints.size() == 9 * layers + 5 && floats.size() == 3,
                "DecoderStack: ", layers, " layers need 14 tensors and 9 ints each (+1 tensor, "
                "+5 ints) and 3 floats; got ", tensors.size(), ", ", ints.size(), ", ",
                floats.size());
    for (size_t l = 0; l < layers; ++l) {
      const at::Tensor* t = &tensors[14 * l];
      const int64_t* i = &ints[9 * l];
      Layer layer{t[0], t[1], {}, i[8]};
      for (int j = 0; j < 4; ++j) {
        const at::Tensor& bias = t[2 + 3 * j + 2];
        layer.linears[j] = Linear{i[2 * j], i[2 * j + 1], t[2 + 3 * j], t[2 + 3 * j + 1],
                                  bias.numel() ? bias : at::Tensor(), ints[9 * layers + 4]};
        TORCH_CHECK(i[2 * j] >= AVX2_INT4 && i[2 * j] <= VNNI_INT8, "unknown linear kind ",
                    i[2 * j]);
      }
      layers_.push_back(std::move(layer));
    }
    final_norm_ = tensors.back();
    num_q_ = ints[9 * layers];
    num_kv_ = ints[9 * layers + 1];
    head_dim_ = ints[9 * layers + 2];
    attention_kind_ = ints[9 * layers + 3];
    TORCH_CHECK(attention_kind_ >= AVX2_ATTENTION && attention_kind_ <= AMX_ATTENTION,
                "unknown attention kind ", attention_kind_);
    if (attention_kind_ != AVX2_ATTENTION) {  // the AVX-512 library's ops (CPUAttention's)
      attention_op_ = op<AttentionOp>(attention_kind_ == AVX512_ATTENTION ? "sgl_cpu_vnni::attention"
                                      : attention_kind_ == BF16_ATTENTION
                                          ? "sgl_cpu_vnni::attention_bf16"
                                          : "sgl_cpu_vnni::attention_amx");
      silu_op_ = op<SiluOp>("sgl_cpu_vnni::silu_mul");
      norm_op_ = op<NormOp>("sgl_cpu_vnni::rms_norm");
      add_norm_op_ = op<AddNormOp>("sgl_cpu_vnni::add_rms_norm");
      rope_op_ = op<RopeOp>("sgl_cpu_vnni::rope_store");
      // gate/up + that SiLU in one VNNI call where the tiles split into gate and up halves
      for (Layer& layer : layers_) {
        const Linear& gate_up = layer.linears[2];
        layer.fused_gate_up = gate_up.kind == VNNI_INT4 && !gate_up.bias.defined() &&
                              gate_up.out_features % 32 == 0;
      }
    }
    eps_ = floats[0];
    scale_ = floats[1];
    softcap_ = floats[2];
  }

  // x [T, H] the token embeddings (the residual stream; updated in place); cos, sin [T, D];
  // the attention metadata as sgl_cpu::attention and rope_store take it; out_rows: [N] int64
  // indices of the rows wanted, or None for all. Returns the final-normed hidden states of
  // those rows, [N, H] ([T, H] for all): the last layer stores and attends every row's K/V but
  // runs o_proj and the MLP on the N rows alone (as server/model/llama.py's loop does).
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor req_to_token,
                     at::Tensor req_rows, at::Tensor prefix_lens, at::Tensor extend_lens,
                     at::Tensor loc, std::optional<at::Tensor> out_rows) {
    return run(x, cos, sin, req_to_token, req_rows, prefix_lens, extend_lens, loc, out_rows,
               nullptr);
  }

  // forward with LoRA adapters added to every projection (see Lora): lora_w 11 tensors a
  // layer, masks the three [T, n * P * R] masks (P = 1, 2, 3; none in SGMV mode), slots [T]
  // int64, rank R, mode (LoraMode).
  at::Tensor forward_lora(at::Tensor x, at::Tensor cos, at::Tensor sin,
                          at::Tensor req_to_token, at::Tensor req_rows,
                          at::Tensor prefix_lens, at::Tensor extend_lens, at::Tensor loc,
                          std::optional<at::Tensor> out_rows, std::vector<at::Tensor> lora_w,
                          std::vector<at::Tensor> masks, at::Tensor slots, int64_t rank,
                          int64_t mode) {
    TORCH_CHECK(lora_w.size() == 11 * layers_.size() &&
                    masks.size() == (mode == LORA_SGMV ? 0u : 3u),
                "forward_lora: 11 LoRA tensors a layer and 3 masks (none for SGMV)");
    Lora lora{lora_w, std::move(masks), slots.contiguous(), rank, mode};
    return run(x, cos, sin, req_to_token, req_rows, prefix_lens, extend_lens, loc, out_rows,
               &lora);
  }

 private:
  at::Tensor run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor req_to_token,
                 at::Tensor req_rows, at::Tensor prefix_lens, at::Tensor extend_lens,
                 at::Tensor loc, std::optional<at::Tensor> out_rows, Lora* lora) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
    TORCH_CHECK(!out_rows || (out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong),
                "out_rows must be a [N] int64 tensor");
    int64_t T = x.size(0);
    const int64_t D = head_dim_;
    // each direct call is a profiler range named as its op, as when Python dispatches it
    at::Tensor h;
    {
      RECORD_FUNCTION("sgl_cpu::rms_norm", std::vector<c10::IValue>());
      h = norm_op_ ? norm_op_->call(x, layers_[0].input_norm, eps_)
                   : rms_norm(x, layers_[0].input_norm, eps_);
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      Layer& layer = layers_[l];
      at::Tensor qkv = layer.linears[0](h);
      if (lora) qkv = lora->add_to(l, 0, h, qkv);
      {
        RECORD_FUNCTION("sgl_cpu::rope_store", std::vector<c10::IValue>());
        if (rope_op_) rope_op_->call(qkv, cos, sin, num_q_, num_kv_, D, k_[l], v_[l], loc);
        else rope_store(qkv, cos, sin, num_q_, num_kv_, D, k_[l], v_[l], loc);
      }
      const at::Tensor q = qkv.narrow(1, 0, num_q_ * D).view({T, num_q_, D});
      at::Tensor o;
      {
        RECORD_FUNCTION("sgl_cpu::attention", std::vector<c10::IValue>());
        o = attention_op_
                ? attention_op_->call(q, k_[l], v_[l], req_to_token, req_rows, prefix_lens,
                                      extend_lens, scale_, layer.window, softcap_)
                : attention(q, k_[l], v_[l], req_to_token, req_rows, prefix_lens, extend_lens,
                            scale_, layer.window, softcap_);
      }
      if (out_rows && l + 1 == layers_.size()) {
        T = out_rows->numel();
        if (T == 0) return x.new_empty({0, x.size(1)});
        o = o.index_select(0, *out_rows);
        x = x.index_select(0, *out_rows);
        if (lora) {
          for (at::Tensor& m : lora->masks) m = m.index_select(0, *out_rows);
          lora->slots = lora->slots.index_select(0, *out_rows);
        }
      }
      o = o.reshape({T, -1});
      o = lora ? lora->add_to(l, 1, o, layer.linears[1](o)) : layer.linears[1](o);
      {
        RECORD_FUNCTION("sgl_cpu::add_rms_norm", std::vector<c10::IValue>());
        h = add_norm(o, x, layer.post_norm);
      }
      at::Tensor act;
      // fused: the same values, without the [T, 2 I] one (on AMX tiles for long passes)
      if (layer.fused_gate_up && !lora) {
        static const auto f = op<Int4Op>("sgl_cpu_vnni::int4_linear_silu");
        static const auto fa = op<Int4Op>("sgl_cpu_vnni::amx_int4_linear_silu");
        act = (layer.linears[2].on_amx(h) ? fa : f)
                  .call(h, layer.linears[2].packed, layer.linears[2].out_features);
      } else {
        act = layer.linears[2](h);
        if (lora) act = lora->add_to(l, 2, h, act);
        RECORD_FUNCTION("sgl_cpu::silu_mul", std::vector<c10::IValue>());
        act = silu_op_ ? silu_op_->call(act) : silu_mul(act);
      }
      at::Tensor out = layer.linears[3](act);
      if (lora) out = lora->add_to(l, 3, act, out);
      {
        RECORD_FUNCTION("sgl_cpu::add_rms_norm", std::vector<c10::IValue>());
        h = add_norm(out, x, l + 1 < layers_.size() ? layers_[l + 1].input_norm : final_norm_);
      }
    }
    return h;
  }

  // residual += x, then its RMSNorm, on the AVX-512 library's op where attention runs there
  at::Tensor add_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w) const {
    return add_norm_op_ ? add_norm_op_->call(x, residual, w, eps_)
                        : add_rms_norm(x, residual, w, eps_);
  }

  struct Layer {
    at::Tensor input_norm, post_norm;
    Linear linears[4];  // qkv_proj, o_proj, gate_up_proj, down_proj
    int64_t window;
    bool fused_gate_up = false;  // sgl_cpu_vnni::int4_linear_silu runs gate_up and SiLU
  };
  std::vector<Layer> layers_;
  std::vector<at::Tensor> k_, v_;
  at::Tensor final_norm_;
  int64_t num_q_ = 0, num_kv_ = 0, head_dim_ = 0, attention_kind_ = AVX2_ATTENTION;
  std::optional<c10::TypedOperatorHandle<AttentionOp>> attention_op_;
  std::optional<c10::TypedOperatorHandle<SiluOp>> silu_op_;
  std::optional<c10::TypedOperatorHandle<NormOp>> norm_op_;
  std::optional<c10::TypedOperatorHandle<AddNormOp>> add_norm_op_;
  std::optional<c10::TypedOperatorHandle<RopeOp>> rope_op_;
  double eps_ = 0, scale_ = 0, softcap_ = 0;
};

}  // namespace sgl_cpu

TORCH_LIBRARY_FRAGMENT(sgl_cpu, m) {
  m.class_<sgl_cpu::DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<double>>())
      .def("forward", &sgl_cpu::DecoderStack::forward)
      .def("forward_lora", &sgl_cpu::DecoderStack::forward_lora);
}
