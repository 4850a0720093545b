"""ForwardBatch (scheduler -> runner) and RunnerOutput (runner -> scheduler): the two plain types
at the scheduler/runner boundary. The scheduler is testable with a fake runner that maps one to
the other."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class ForwardMode(enum.Enum):
    """What kind of pass a ForwardBatch is (attention kernels differ between the two)."""

    EXTEND = "extend"  # new tokens of several sequences (prefill, chunked prefill, forced text)
    DECODE = "decode"  # exactly one new token per sequence


@dataclass
class ForwardBatch:
    """One forward pass over B sequences and T = sum(extend_lens) new tokens.

    Attributes:
        mode: extend or decode.
        req_ids: [B] request ids, in batch order (bookkeeping for the scheduler; the runner
            ignores them).
        input_ids: [T] int64 token ids, sequences concatenated in batch order.
        positions: [T] int64 position of each token in its sequence.
        out_cache_loc: [T] int64 KV slot each new token's K/V is written to.
        req_rows: [B] rows of ``req_to_token`` (already filled for positions < seq_len).
        prefix_lens: [B] tokens whose KV is already in the pool before this pass.
        extend_lens: [B] new tokens per sequence (all 1 in decode).
        logits_indices: [N] int64 indices into the T tokens whose next-token logits are wanted
            (usually the last token of each sequence that finishes its prompt; more for prompt
            logprobs; none for a middle prefill chunk).
        req_to_token: the request table tensor [max_requests, max_context] int64.
        images: image positions of this pass (multimodal models): (first token row in the T
            tokens, the :class:`ImageInput`, first and end image position covered), in order.
        lora_slots: [B] each sequence's LoRA adapter slot (-1: the base model); empty: all
            base (:mod:`server.model.lora`).
    """

    mode: ForwardMode
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    logits_indices: torch.Tensor
    req_to_token: torch.Tensor
    images: list[tuple[int, "ImageInput", int, int]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        """B, the sequences in the pass."""
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        """T, the new tokens in the pass."""
        return int(self.input_ids.numel())


@dataclass(eq=False)
class ImageInput:
    """One image of a request: prompt positions [offset, offset + length) hold its vectors.

    Attributes:
        offset, length: in tokens.
        key: the radix-cache id of its positions (:func:`server.model.vision.image_key`).
        pixel_values: [1, 3, H, W] float32 (the image processor's output).
        embeds: [length, hidden], filled by the runner the first time a pass needs them (so an
            image is encoded once per request, and never when its positions were cached).
    """

    offset: int
    length: int
    key: int
    pixel_values: torch.Tensor
    embeds: torch.Tensor | None = None


@dataclass
class RunnerOutput:
    """logits: [N, vocab] float32, row i for ``batch.logits_indices[i]``; hidden: those rows'
    final hidden states [N, hidden] (after the final norm, the model's dtype), None where the
    pass does not keep them (a replayed CUDA graph); pooled: an encoder's output of the sequence
    holding each row ([N, D] float32: its pooled vector, or a cross-encoder's logits;
    :mod:`server.model.encoder_runner`), None for a decoder."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
