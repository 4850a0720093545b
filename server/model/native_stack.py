"""The decoder stack as one native call (``sgl_cpu::DecoderStack``, ``kernels/cpu/csrc/
decoder_stack.cpp``): the layers' norms, quantized linears, RoPE + K/V store, attention and
SiLU * up run from C++ in the order :class:`server.model.llama.DecoderLayer` runs them, so a
forward pass costs one Python call instead of ~10 a layer. Outputs are bitwise those of the
Python loop (tested), which stays the reference and runs every model this does not take.

:func:`build_native_stack` returns None (the Python loop runs) unless every layer is the plain
Llama shape on the native CPU kernels: the ``cpu`` attention backend with its fused ops, every
linear a :class:`QuantLinear` on a ``kernels.cpu`` kernel, SiLU, no per-head Q/K norms, no
sandwich norms, no experts, one RoPE table, no tensor parallelism and no torch.compile.
"""

from __future__ import annotations

import torch

from server.model.quantization import QuantLinear

# the codes decoder_stack.cpp's LinearKind gives each (kernel, kind) pair
_LINEAR_KINDS = {("avx2", "int4"): 0, ("avx2", "int8"): 1,
                 ("avx512_vnni", "int4"): 2, ("avx512_vnni", "int8"): 3}
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# decoder_stack.cpp's AttentionKind per CPUAttention.kernel
_ATTENTION_KINDS = {"avx2": 0, "avx512_vnni": 1, "avx512_bf16": 2, "amx": 3}


def unsupported_reason(model, attention) -> str | None:
    """Why ``model`` (a LlamaForCausalLM) cannot run as one native call with ``attention``, or
    None when it can."""
    arch = model.arch
    if getattr(attention, "name", None) != "cpu" or not getattr(attention, "fused", False):
        return "the attention backend is not the native cpu one"
    if model.tp is not None:
        return "tensor parallelism"
    if (arch.sandwich_norms or arch.qk_norm or arch.sparse_layers or arch.hidden_act != "silu"
            or arch.local_rope_theta is not None):
        return f"{arch.model_type}'s layers differ from Llama's"
    dtype = model.norm.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}"
    for layer in model.layers:
        for name in _PROJECTIONS:
            linear = getattr(layer, name)
            if not isinstance(linear, QuantLinear) or not linear.native or linear.dense is not None:
                return f"layer {layer.layer_id}'s {name} is not on a native linear kernel"
    return None


def build_native_stack(model, attention) -> "torch.ScriptObject | None":
    """A ``torch.classes.sgl_cpu.DecoderStack`` over ``model``'s layers (their packed weights
    are shared, not copied) and ``attention``'s KV buffers, or None when
    :func:`unsupported_reason` names a reason (or the library lacks the class)."""
    if unsupported_reason(model, attention) is not None:
        return None
    try:
        cls = torch.classes.sgl_cpu.DecoderStack
    except (AttributeError, RuntimeError):
        return None
    dtype = model.norm.dtype
    empty = torch.empty(0, dtype=dtype)
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    for layer in model.layers:
        tensors += [layer.input_layernorm.data, layer.post_attention_layernorm.data]
        for name in _PROJECTIONS:
            linear: QuantLinear = getattr(layer, name)
            bias = empty if linear.bias is None else linear.bias.data.to(dtype)
            tensors += [linear.packed, linear.scales_and_zeros, bias]
            ints += [_LINEAR_KINDS[linear.native, linear.kind], linear.out_features]
        ints.append(layer.window)
    tensors.append(model.norm.data)
    first = model.layers[0]
    amx = [linear.dense_min_rows for layer in model.layers for name in _PROJECTIONS
           if (linear := getattr(layer, name)).amx]
    ints += [first.num_heads, first.num_kv_heads, first.head_dim,
             _ATTENTION_KINDS[attention.kernel], amx[0] if amx else 0]
    return cls(tensors, ints, list(attention.k_buffers), list(attention.v_buffers),
               [float(first.eps), float(first.scale), float(first.softcap or 0.0)])
