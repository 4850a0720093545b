"""Assemble a model's parameters from checkpoint tensors: dense copies, fused row blocks, and
linear/embedding weights kept quantized (:mod:`server.model.quantization`).

The model is built on the meta device; nothing is allocated until its tensor arrives, so a
quantized model never holds a float copy of its linear weights. A model supplies one mapping,
``param_target(hf_name) -> (param name, row offset, rows) | None`` (None: skip the tensor),
and every family shares this loader.

Errors: :class:`WeightLoadError` for an unexpected, missing or mis-shaped tensor;
:class:`server.model.quantization.QuantizationError` for an unknown mode.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from server.model.quantization import (
    QUANTIZATION_MODES,
    QuantEmbedding,
    QuantizationError,
    QuantizedWeight,
    QuantLinear,
    cat_rows,
    int4_supported,
    quantize,
)

Target = tuple[str, int, int | None]  # our parameter name, first row, rows (None = all)


class WeightLoadError(RuntimeError):
    """The checkpoint lacks a parameter, has an unexpected one, or a shape differs."""


@dataclass
class QuantReport:
    """What the loader kept quantized. ``modules``: "int4"/"int8"/"dense" -> module count;
    ``sources``: e.g. "Q4_1" -> tensors; ``weight_bytes``: bytes of all parameters and packed
    buffers; ``prefill_copy_bytes``: of those, the dense bf16 copies kept for long extends;
    ``off_native``: quantized modules that run torch's ops although ``native`` was asked (a
    shape the kernels do not take)."""

    mode: str
    dense_min_rows: int | None = None
    native: str | None = None  # the kernels.cpu linear kernel quantized linears run on
    modules: Counter = field(default_factory=Counter)
    sources: Counter = field(default_factory=Counter)
    weight_bytes: int = 0
    prefill_copy_bytes: int = 0
    off_native: int = 0
    amx_modules: int = 0  # int4 linears whose long extends run on AMX tiles instead of a copy

    @property
    def row_invariant(self) -> bool:
        """Every linear layer computes a row the same whatever else is in the pass: all of
        them quantized onto the kernels.cpu library (one accumulator per output, fed in k
        order), none dense (torch's matmuls), no dense copy and no AMX tiles for long extends."""
        return (self.native and self.modules["int4"] + self.modules["int8"] > 0
                and self.modules["dense"] == 0 and self.off_native == 0
                and self.prefill_copy_bytes == 0 and self.amx_modules == 0)

    def summary(self) -> str:
        """One line for logs and /get_model_info, e.g.
        "auto: int4 x120, int8 x1 [Q4_1 x120, Q8_0 -> int8 x1], 91 MiB"."""
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.modules.items()) if n)
        src = ", ".join(f"{s} x{n}" for s, n in sorted(self.sources.items()))
        packed = (self.weight_bytes - self.prefill_copy_bytes) / 2**20
        dense = (f" + {self.prefill_copy_bytes / 2**20:.0f} MiB bf16 copies for extends of >= "
                 f"{self.dense_min_rows} tokens" if self.prefill_copy_bytes else "")
        kernel = f" on sgl_cpu {self.native} kernels" if self.native and self.sources else ""
        amx = (f", {self.amx_modules} int4 x AMX bf16 tiles for extends of >= "
               f"{self.dense_min_rows} tokens" if self.amx_modules else "")
        return f"{self.mode}: {kinds} [{src}], {packed:.0f} MiB{dense}{kernel}{amx}"


def _module_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
                 param_target: Callable[[str], Target | None], *, dtype: torch.dtype,
                 device: torch.device, quantization: str = "none",
                 dense_min_rows: int | None = None, native: str | None = None) -> QuantReport:
    """Fill ``model`` (built on the meta device) from ``weights``.

    Args:
        weights: (HF name, float tensor or QuantizedWeight) pairs.
        param_target: maps an HF name to where its rows go (a fused parameter takes several).
        dtype, device: of the dense parameters.
        quantization: "none" (dequantize everything), "auto" (keep what arrives quantized),
            "int4" / "int8" (quantize every ``nn.Linear`` weight and ``nn.Embedding``).
        dense_min_rows: quantized linears also keep a dense bf16 copy for inputs of at least
            this many rows (prefill on CPUs with native bf16; see :class:`QuantLinear`).
        native: the ``kernels.cpu`` linear kernel quantized linears run on ("avx2",
            "avx512_vnni"; see :class:`QuantLinear`), or None for torch's packed ops; the
            caller checks that it is available.

    Returns a :class:`QuantReport`. Raises WeightLoadError, QuantizationError.
    """
    # one pass over the checkpoint's tensors that must see every target (fused rows, quantized
    # or dense, tied weights) to fill the model in place
    if quantization not in QUANTIZATION_MODES:
        raise QuantizationError(
            f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    params = dict(model.named_parameters())
    quantizable = {f"{n}.weight" for n, m in model.named_modules()
                   if isinstance(m, (nn.Linear, nn.Embedding))}
    left = {name: p.shape[0] for name, p in params.items()}
    report = QuantReport(quantization, native=native)
    installed: set[str] = set()  # quantized parameters, installed as their last block came
    dense: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[int, torch.Tensor | QuantizedWeight]]] = defaultdict(list)

    def _install(name: str, blocks: list) -> None:
        report.dense_min_rows = dense_min_rows
        _install_quantized(model, name, blocks, quantization, dtype, device, report,
                           dense_min_rows, native)
        installed.add(name)

    for hf_name, tensor in weights:
        target = param_target(hf_name)
        if target is None:
            continue
        ours, offset, rows = target
        if ours not in params:
            raise WeightLoadError(f"unexpected weight {hf_name!r} in checkpoint")
        full = params[ours].shape
        rows = full[0] if rows is None else rows
        expected = (rows, *full[1:])
        if tuple(tensor.shape) != expected:
            raise WeightLoadError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != "
                                  f"expected {expected}")
        left[ours] -= rows
        keep = quantization in ("int4", "int8") or (
            quantization == "auto" and isinstance(tensor, QuantizedWeight))
        # The first block of a parameter decides: later blocks follow it (dense or quantized).
        if ours in quantizable and ours not in dense and (keep or ours in parts):
            parts[ours].append((offset, tensor))
            if not left[ours] and getattr(model.get_submodule(ours.rsplit(".", 1)[0]),
                                          "bias", None) is None:
                # every block is in (and no dense bias to wait for): quantize now and let
                # the float blocks go, so a checkpoint is never held whole in float
                _install(ours, parts.pop(ours))
            continue
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        if ours not in dense:
            dense[ours] = torch.empty(full, dtype=dtype, device=device)
        dense[ours][offset:offset + rows].copy_(tensor)
    missing = [n for n, r in left.items() if r]
    if missing:
        raise WeightLoadError(f"weights missing from checkpoint: {missing[:8]}")

    for name, t in dense.items():
        module, attr = _module_of(model, name)
        setattr(module, attr, nn.Parameter(t, requires_grad=False))
        report.weight_bytes += t.nbytes
    for name, blocks in parts.items():  # those with a bias, now that it is in place
        _install(name, blocks)
    report.modules["dense"] = sum(1 for n in quantizable if n not in installed)
    return report


def _target_kind(blocks: list, quantization: str, n: int, k: int) -> str:
    if quantization in ("int4", "int8"):
        kind = quantization
    else:  # auto: int4 only when every block already is int4
        kinds = {b.kind if isinstance(b, QuantizedWeight) else "float" for _, b in blocks}
        kind = "int4" if kinds == {"int4"} else "int8"
    return "int8" if kind == "int4" and not int4_supported(n, k) else kind


def _install_quantized(model: nn.Module, name: str, blocks: list, quantization: str,
                       dtype: torch.dtype, device: torch.device, report: QuantReport,
                       dense_min_rows: int | None, native: str | None) -> None:
    module_name = name.rsplit(".", 1)[0]
    module = model.get_submodule(module_name)
    n, k = module.weight.shape
    kind = _target_kind(blocks, quantization, n, k)
    blocks.sort(key=lambda b: b[0])
    weight = cat_rows([quantize(b, kind) for _, b in blocks])
    for part in {b.source if isinstance(b, QuantizedWeight) and b.kind == kind
                 else f"{getattr(b, 'source', 'float')} -> {kind}" for _, b in blocks}:
        report.sources[part] += 1
    report.modules[kind] += 1
    # the native kernels take K in multiples of 32 (int4 blocks, VNNI) or 8 (AVX2 int8 rows)
    if native:
        from kernels.cpu import k_multiple

        native = native if k % k_multiple(native, kind) == 0 else None
    if report.native and not native:
        report.off_native += 1
    if isinstance(module, nn.Embedding):
        tied = getattr(model, "lm_head", True) is None
        new: nn.Module = QuantEmbedding(weight, dtype, tied, native)
        report.weight_bytes += sum(b.nbytes for b in new.buffers())
    else:
        bias = module.bias if module.bias is not None and module.bias.device.type != "meta" \
            else None
        if module.bias is not None and bias is None:
            raise WeightLoadError(f"{module_name}.bias missing from checkpoint")
        new = QuantLinear(weight, bias, dense_min_rows, native)
        report.weight_bytes += new.nbytes
        report.prefill_copy_bytes += 0 if new.dense is None else new.dense.nbytes
        report.amx_modules += new.amx
    parent, attr = _module_of(model, module_name)
    setattr(parent, attr, new.to(device))
