"""The offline engine's and the scheduler's side of images in prompts: a prompt's images
checked and its image tokens expanded (:func:`server.multimodal.expand_prompt_images`, the
path the HTTP process takes too), pixel values computed by the checkpoint's image processor on
a worker thread (:mod:`server.model.vision`), and the :class:`ImageInput` records a request
carries. Errors are InvalidRequestError with param "image_data".
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Sequence

import torch

from server.model.forward_batch import ImageInput
from server.multimodal import ImageError, VisionSpec, expand_prompt_images
from server.scheduler.validation import InvalidRequestError


class EngineImages:
    """Images for one model: ``spec`` (None for a text-only model), ``model_path`` (where
    its image processor's config lives) and ``bos_id`` (images without placeholders go after
    it)."""

    def __init__(self, spec: VisionSpec | None, model_path: str, bos_id: int | None):
        self.spec, self._model_path, self._bos_id = spec, model_path, bos_id
        self._processor = None
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _spec(self) -> VisionSpec:
        if self.spec is None:
            raise InvalidRequestError("image_data", "this model is text-only")
        return self.spec

    def expand(self, ids: Sequence[int], images: Sequence[bytes]
               ) -> tuple[list[int], list[tuple[int, int, bytes]]]:
        """Check ``images`` (encoded bytes) and expand the prompt's image tokens; returns the
        ids and, per image, (offset, cache key, bytes): ``Engine.make_request``'s ``images``.
        Raises InvalidRequestError."""
        spec = self._spec()
        try:
            return expand_prompt_images(ids, images, spec, self._bos_id)
        except ImageError as exc:
            raise InvalidRequestError("image_data", str(exc)) from exc

    def preprocess_async(self, images: Sequence[bytes]) -> concurrent.futures.Future:
        """A future of the pixel values of ``images`` (encoded bytes, already checked), each
        [1, 3, H, W] float32, computed by the checkpoint's image processor on a worker thread:
        a large image takes ~0.3 s to decode and resize (4096x4096, measured), which must not
        stall the scheduler loop. The future raises InvalidRequestError for a text-only model
        or an image the processor cannot read."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="images")
        return self._pool.submit(self.preprocess, list(images))

    def preprocess(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Pixel values of each image (see :meth:`preprocess_async`), on this thread.
        Raises InvalidRequestError."""
        self._spec()
        with self._lock:
            if self._processor is None:
                from server.model.vision import ImageProcessor

                self._processor = ImageProcessor(self._model_path)
        try:
            return [self._processor(data) for data in images]
        except Exception as exc:  # noqa: BLE001 - any decoder failure is the image's fault
            raise InvalidRequestError("image_data", f"the image processor could not read an "
                                      f"image: {type(exc).__name__}: {exc}") from exc

    def inputs(self, ids: list[int], images: Sequence[tuple[int, int, bytes]],
               pixels: Sequence[torch.Tensor] | None = None) -> tuple[ImageInput, ...]:
        """The ImageInput of each image of a request whose expanded ``ids`` hold them at the
        given offsets (``pixels`` precomputed, else computed here). Raises
        InvalidRequestError when an offset does not start a run of image tokens."""
        spec = self._spec()
        if pixels is None:
            pixels = self.preprocess([data for _, _, data in images])
        out = []
        for (offset, key, _), values in zip(images, pixels):
            n = spec.tokens_per_image
            if ids[offset:offset + n] != [spec.image_token_id] * n:
                raise InvalidRequestError("image_data", f"no run of {n} image tokens at {offset}")
            out.append(ImageInput(offset, n, key, values))
        return tuple(out)
