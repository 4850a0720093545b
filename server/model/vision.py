"""LLaVA-style image encoding: a CLIP or SigLIP vision tower from transformers, the
multimodal projector, and the checkpoint's own image processor.

The model (LLaVA 1.5, Liu et al. 2023, "Improved Baselines with Visual Instruction Tuning" §2;
reference implementation: transformers ``modeling_llava``, ``LlavaModel.get_image_features``):
an image becomes ``tokens_per_image`` vectors, the vision tower's hidden states at
``vision_feature_layer`` (without the CLS position under the "default" strategy) mapped by a
two-layer MLP into the language model's embedding space. The prompt holds one image token per
vector; the language model reads the vectors in their place.

The prompt side (image tokens, radix-cache keys, limits) is :mod:`server.multimodal`.
Any-resolution tiling (``llava_next``) is not supported: such checkpoints are refused at load.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from server.multimodal import ImageError, vision_spec


class VisionEncoder(nn.Module):
    """The vision tower and projector of a LLaVA checkpoint.

    Args: cfg: the HF ``config.json`` dict (model_type "llava"); dtype, device: of the weights.
    """

    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device):
        super().__init__()
        from transformers import AutoConfig, AutoModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.spec = vision_spec(cfg)
        if self.spec is None:
            raise ImageError(f"model_type {cfg.get('model_type')!r} has no vision tower")
        config = LlavaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        vcfg = config.vision_config
        if isinstance(vcfg, dict):
            vcfg = AutoConfig.for_model(**vcfg)
        self.layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.tower = AutoModel.from_config(vcfg)
        self.projector = LlavaMultiModalProjector(config)
        self.to(dtype=dtype, device=device).eval()
        self.dtype, self.device = dtype, device

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the tower and projector tensors from a checkpoint's (name, tensor) stream
        (transformers 4 names ``vision_tower.X`` or 5 names ``model.vision_tower.X``); other
        names are skipped. Raises ImageError if a parameter is missing."""
        state: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower."):
                state["tower." + name[len("vision_tower."):]] = tensor
            elif name.startswith("multi_modal_projector."):
                state["projector." + name[len("multi_modal_projector."):]] = tensor
        own = self.state_dict()
        # CLIPVisionModel's parameters live under "vision_model."; some exports omit it
        for key in list(state):
            if key not in own and key.startswith("tower.") and \
                    "tower.vision_model." + key[6:] in own:
                state["tower.vision_model." + key[6:]] = state.pop(key)
        missing = [k for k in own if k not in state and not k.endswith("position_ids")]
        if missing:
            raise ImageError(f"vision weights missing from the checkpoint: {missing[:3]}")
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items() if k in own},
                             strict=False)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values: [N, 3, H, W] float (the image processor's output). Returns
        [N, tokens_per_image, text hidden] in the weights' dtype."""
        out = self.tower(pixel_values.to(self.device, self.dtype), output_hidden_states=True)
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        feats = [out.hidden_states[i] for i in layers]
        if self.strategy == "default":
            feats = [f[:, 1:] for f in feats]
        return self.projector(torch.cat(feats, dim=-1))


class ImageProcessor:
    """The checkpoint's own image processor (transformers ``AutoImageProcessor``; without
    torchvision transformers picks its PIL-based variant).

    Args: path: the checkpoint directory (its ``preprocessor_config.json``).
    """

    def __init__(self, path: str):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path)

    def __call__(self, data: bytes) -> torch.Tensor:
        """Encoded image bytes, already checked by :func:`server.multimodal.check_image` ->
        pixel_values [1, 3, H, W] float32."""
        import io

        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
        return torch.as_tensor(self.processor(images=rgb, return_tensors="np")["pixel_values"],
                               dtype=torch.float32)
