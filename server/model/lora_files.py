"""Reading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as
``peft``'s ``save_pretrained`` writes it) and mapping it onto this server's decoder layers.

A LoRA adapter adds ``(alpha / r) * B A x`` to a linear layer's output ``W x`` (Hu et al. 2021,
"LoRA", eq. 3; ``alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023); A is [r, in], B [out, r].
HF projections fused in our layers (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``)
map to row ranges of the fused output, found with the model's own
:meth:`server.model.llama.LlamaForCausalLM.param_target`, so every family the loader takes
(Phi-3's pre-fused checkpoints included) maps the same way its base weights do.

Refused with a :class:`LoraError` naming the reason: DoRA, trained biases, ``modules_to_save``
(a fine-tuned embedding or head), ``alpha_pattern``, ``fan_in_fan_out`` (GPT-2's Conv1D),
LoRA on embeddings, the LM head or MoE experts, and any tensor whose shape does not fit the
base model (an adapter trained on another base).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import torch

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_PREFIX = "base_model.model."
# adapter_config.json keys whose set (truthy) value we cannot serve, and why
_REFUSED = {
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "modules_to_save": "modules_to_save (fully fine-tuned modules, e.g. the LM head) are not "
                       "supported",
    "alpha_pattern": "alpha_pattern (per-module alphas) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) does not apply to this model",
    "layer_replication": "layer_replication is not supported",
    "lora_bias": "trained LoRA biases are not supported",
    "use_qalora": "QA-LoRA is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "trainable_token_indices": "trainable token indices are not supported",
}


class LoraError(ValueError):
    """An adapter that cannot be served here; the message says why (HTTP 400 at load)."""


@dataclass
class LoraPart:
    """One HF projection's factors: rows [offset, offset + rows) of our fused projection
    ``proj`` of layer ``layer``. ``a``: [r, in] float32; ``b``: [rows, r] float32 with the
    scale (alpha / r, or alpha / sqrt(r) with rsLoRA) folded in."""

    layer: int
    proj: str
    offset: int
    rows: int
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoraAdapter:
    """An adapter read and checked against a model. ``rank``: the largest r of its parts;
    ``digest``: a hash of its weights file (its radix-cache namespace: the same name loaded
    with other weights never reuses the old KV)."""

    name: str
    path: str
    rank: int
    digest: str
    parts: list[LoraPart] = field(default_factory=list)


def read_adapter(name: str, path: str, model) -> LoraAdapter:
    """Read the PEFT adapter directory ``path`` for ``model`` (a loaded
    :class:`server.model.llama.LlamaForCausalLM`). Raises LoraError (missing files, refused
    features, shapes that do not fit the model)."""
    config = _read_config(path)
    weights_file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(weights_file):
        from safetensors.torch import load_file

        tensors = load_file(weights_file)
    elif os.path.isfile(os.path.join(path, "adapter_model.bin")):
        weights_file = os.path.join(path, "adapter_model.bin")
        tensors = torch.load(weights_file, map_location="cpu", weights_only=True)
    else:
        raise LoraError(f"adapter {name!r}: no adapter_model.safetensors in {path}")
    with open(weights_file, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    alpha = float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, kind = _split_key(name, key)
        pairs.setdefault(module, {})[kind] = tensor
    parts = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: {module} has only lora_{''.join(ab)}")
        a, b = ab["A"].float(), ab["B"].float()
        r = a.shape[0]
        scale = alpha / (math.sqrt(r) if rslora else r)
        parts.append(_place(name, module, a, b * scale, model))
    if not parts:
        raise LoraError(f"adapter {name!r}: no LoRA weights in {weights_file}")
    return LoraAdapter(name, path, max(p.a.shape[0] for p in parts), digest, parts)


def adapter_rank(path: str) -> int:
    """The largest rank (r, or a ``rank_pattern`` value) ``path``'s adapter_config.json gives.
    Raises LoraError."""
    config = _read_config(path)
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def _read_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"no adapter_config.json in {path}") from None
    except (OSError, ValueError) as exc:
        raise LoraError(f"cannot read {file}: {exc}") from exc
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{path} is a {config.get('peft_type')} adapter; only LoRA is served")
    for key, why in _REFUSED.items():
        if config.get(key):
            raise LoraError(f"{path}: {why}")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{path}: trained biases (bias={config['bias']!r}) are not supported")
    return config


def _split_key(name: str, key: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (<module>, "A")."""
    for kind in ("A", "B"):
        suffix = f".lora_{kind}.weight"
        if key.endswith(suffix):
            module = key[:-len(suffix)]
            return (module[len(_PREFIX):] if module.startswith(_PREFIX) else module), kind
    raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight (LoRA on "
                    "embeddings and DoRA magnitudes are not supported)")


def _place(name: str, module: str, a: torch.Tensor, b: torch.Tensor, model) -> LoraPart:
    """Where HF module ``module``'s factors go in ``model``, checked against its shapes."""
    target = model.param_target(module + ".weight")
    where = target[0].split(".") if target else []
    if (target is None or len(where) != 4 or where[0] != "layers" or where[2] not in PROJECTIONS
            or where[3] != "weight"):
        raise LoraError(f"adapter {name!r}: LoRA on {module} is not supported (only the "
                        "attention and MLP projections of dense layers)")
    layer, proj = int(where[1]), where[2]
    if layer >= len(model.layers):
        raise LoraError(f"adapter {name!r}: {module} is past the model's {len(model.layers)} "
                        "layers (trained on another base model?)")
    linear = getattr(model.layers[layer], proj)
    offset, rows = target[1], target[2] if target[2] is not None else linear.out_features
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features \
            or b.shape != (rows, a.shape[0]):
        raise LoraError(f"adapter {name!r}: {module} has lora_A {list(a.shape)} and lora_B "
                        f"{list(b.shape)}, but the base model's projection is "
                        f"[{rows}, {linear.in_features}] (trained on another base model?)")
    return LoraPart(layer, proj, offset, rows, a, b)
