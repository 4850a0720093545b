"""Images in prompts, on the tokenizer side (torch-free: the HTTP process imports this).

* :func:`vision_spec`: the image token and positions per image of an HF LLaVA ``config.json``.
* :func:`image_bytes`: an OpenAI ``image_url`` / SGLang ``image_data`` value -> encoded bytes
  (``data:`` URLs and bare base64 only: the server has no network, so http(s) URLs are refused).
* :func:`check_image`: decode with Pillow under size limits; returns the radix-cache key of the
  image, a negative id from a SHA-256 of its RGB pixels (identical images share cached KV,
  different images never do; the SGLang paper's scheme).
* :func:`expand_image_tokens`: each image token of the prompt becomes ``tokens_per_image``
  copies; returns where each image's positions are.

The vectors themselves are computed in the scheduler process (:mod:`server.model.vision`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

MAX_IMAGES = 8  # per request
MAX_IMAGE_BYTES = 20 << 20  # encoded
MAX_IMAGE_PIXELS = 4096 * 4096


class ImageError(ValueError):
    """A bad image or image reference, with a message for the client (a 400)."""


@dataclass(frozen=True)
class VisionSpec:
    """image_token_id: the prompt's placeholder token; tokens_per_image: positions one image
    takes; image_token: its text (what a prompt writes where an image goes)."""

    image_token_id: int
    tokens_per_image: int
    image_token: str = "<image>"


def vision_spec(cfg: Mapping[str, Any]) -> VisionSpec | None:
    """From an HF ``config.json`` dict: None for text models. Raises ImageError for a LLaVA
    config that is not supported (its vision tower or feature strategy)."""
    if cfg.get("model_type") != "llava":  # other configs are text-only here (Gemma 3's
        return None                        # text model; the loader refuses the rest)
    v = cfg.get("vision_config") or {}
    tower = v.get("model_type", "clip_vision_model")
    if tower not in ("clip_vision_model", "siglip_vision_model"):
        raise ImageError(f"vision tower {tower!r} is not supported (supported: "
                         "clip_vision_model, siglip_vision_model)")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ImageError(f"vision_feature_select_strategy {strategy!r} is not supported")
    patches = (int(v.get("image_size", 224)) // int(v.get("patch_size", 32))) ** 2
    # CLIP prepends a CLS position, SigLIP none; "default" drops the first position (as
    # transformers' LlavaModel.get_image_features does)
    cls = 1 if tower == "clip_vision_model" else 0
    tokens = patches + cls - (1 if strategy == "default" else 0)
    token = cfg.get("image_token_id", cfg.get("image_token_index", 32000))
    return VisionSpec(int(token), tokens)


def model_vision_spec(path: str) -> VisionSpec | None:
    """:func:`vision_spec` of a model path (GGUF files are text-only)."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config):
        return None
    with open(config) as f:
        return vision_spec(json.load(f))


def image_bytes(value: Any) -> bytes:
    """A ``data:image/...;base64,...`` URL or bare base64 -> the encoded image. Raises
    ImageError for http(s) URLs, file paths and anything that is not base64."""
    if not isinstance(value, str) or not value:
        raise ImageError("an image must be a data: URL or base64 text")
    if value.startswith(("http://", "https://")):
        raise ImageError("image URLs are not fetched (the server has no network access); "
                         "send the image inline as a data: URL (data:image/png;base64,...)")
    if value.startswith("data:"):
        head, sep, payload = value.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError("a data: URL image must be base64 (data:image/png;base64,...)")
        value = payload
    if len(value) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageError(f"image is over {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError("the image is neither a data: URL nor valid base64") from exc


def check_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> int:
    """Decode ``data`` fully (truncated files fail here, not in the scheduler) and return its
    radix-cache key. Raises ImageError: not an image, truncated, too many pixels or bytes."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(f"image is {w}x{h} pixels; the limit is {max_pixels} pixels")
            rgb = img.convert("RGB")
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError("not a decodable image (PNG, JPEG, GIF, WebP, BMP, ...)") from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image could not be decoded: {exc}") from exc
    digest = hashlib.sha256(f"{w}x{h}:".encode() + rgb.tobytes()).digest()
    return -1 - int.from_bytes(digest[:8], "little") % (1 << 62)


def expand_image_tokens(ids: Sequence[int], spec: VisionSpec, num_images: int,
                        bos_id: int | None = None) -> tuple[list[int], list[int]]:
    """(ids with each image's token run ``tokens_per_image`` long, offset of each image).

    Each run of image tokens in the prompt is one image: a single token (as chat templates
    write it) is repeated, a run of exactly ``tokens_per_image`` (already expanded) is kept. A
    prompt without image tokens gets one image at its start per image (after a BOS token).
    Raises ImageError when the runs are not one per image or have another length, or for
    more than :data:`MAX_IMAGES` images."""
    if num_images > MAX_IMAGES:
        raise ImageError(f"{num_images} images; at most {MAX_IMAGES} per request")
    ids = list(ids)
    tok, n = spec.image_token_id, spec.tokens_per_image
    runs: list[tuple[int, int]] = []  # (start, length)
    i = 0
    while i < len(ids):
        if ids[i] == tok:
            j = i
            while j < len(ids) and ids[j] == tok:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if not runs:
        at = 1 if ids and bos_id is not None and ids[0] == bos_id else 0
        ids[at:at] = [tok] * num_images
        runs = [(at + k, 1) for k in range(num_images)]
    if len(runs) != num_images:
        raise ImageError(f"the prompt has {len(runs)} image placeholders ({spec.image_token!r}) "
                         f"for {num_images} images")
    out: list[int] = []
    offsets = []
    last = 0
    for start, length in runs:
        if length not in (1, n):
            raise ImageError(f"a run of {length} image tokens: write one {spec.image_token!r} "
                             f"per image (or exactly {n})")
        out.extend(ids[last:start])
        offsets.append(len(out))
        out.extend([tok] * n)
        last = start + length
    out.extend(ids[last:])
    return out, offsets


def expand_prompt_images(ids: Sequence[int], images: Sequence[bytes], spec: VisionSpec,
                         bos_id: int | None = None
                         ) -> tuple[list[int], list[tuple[int, int, bytes]]]:
    """Check each image (encoded bytes, :func:`check_image`) and expand the prompt's image
    tokens (:func:`expand_image_tokens`): the expanded ids and, per image, (offset of its token
    run, radix-cache key, bytes). The one path both front ends (the HTTP process's tokenizer
    manager and the offline Engine) take. Raises ImageError."""
    keys = [check_image(b) for b in images]
    ids, offsets = expand_image_tokens(ids, spec, len(images), bos_id)
    return ids, list(zip(offsets, keys, images))
