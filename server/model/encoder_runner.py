"""EncoderRunner: the model runner of a BERT-family encoder (:mod:`server.model.bert`), with
ModelRunner's ``forward(ForwardBatch) -> RunnerOutput`` so the scheduler serves it unchanged.

An encoder attends both ways, so a token's hidden state depends on the tokens after it: no KV
is kept (the pool it is given has no buffers), nothing is reused from the radix cache (the
Engine turns it off) and every sequence arrives whole in one pass (the scheduler's
``whole_prompts``). Each sequence's output is its pooled vector (or a cross-encoder's
relevance logits), in :attr:`RunnerOutput.pooled`.
"""

from __future__ import annotations

import torch

from server.model.bert import BertEncoder
from server.model.forward_batch import ForwardBatch, RunnerOutput
from server.model.loader import LoadedModel


class EncoderRunner:
    """Args:
        loaded: an encoder read by :func:`server.model.loader.load_model` (``arch.encoder``
            set).
        dtype, device: of the weights and the computation.

    Attributes (those the Engine and the scheduler loop read of a runner): ``model``,
    ``quant_report`` (all dense), ``lora`` (None), ``compiled`` (False), ``batch_invariant``
    (False: attention pads to the longest sequence of the pass).
    """

    lora = None
    compiled = False
    batch_invariant = False

    def __init__(self, loaded: LoadedModel, *, dtype: torch.dtype, device: str = "cpu"):
        self.arch = loaded.arch
        self.device = torch.device(device)
        self.sep_id = loaded.tokenizer.sep_token_id
        with torch.device("meta"):
            model = BertEncoder(loaded.arch)
        with torch.no_grad():
            self.quant_report = model.load_weights(loaded.weights(), dtype, self.device)
        self.model = model.eval()

    def close(self) -> None:
        """Nothing to release (ModelRunner's interface)."""

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> RunnerOutput:
        """Encode the pass's sequences (each whole: ``prefix_lens`` all 0). Returns
        ``pooled`` [N, D] float32, row i the output of the sequence holding token
        ``batch.logits_indices[i]``, and empty logits [N, 0]. Raises ValueError for a
        sequence with a computed prefix (an encoder cannot extend one)."""
        if any(batch.prefix_lens):
            raise ValueError("an encoder computes each sequence whole: no cached prefix")
        lens = batch.extend_lens
        ids = batch.input_ids.to(self.device)
        types = self.model.token_types(ids, lens, self.sep_id)
        hidden = self.model(ids, batch.positions.to(self.device), types, lens)
        pooled = self.model.pool(hidden, lens)
        ends = torch.cumsum(torch.tensor(lens), 0)
        rows = torch.searchsorted(ends, batch.logits_indices, right=True)
        return RunnerOutput(torch.empty((len(rows), 0)), pooled=pooled[rows.to(pooled.device)])
