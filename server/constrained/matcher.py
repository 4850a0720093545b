"""One request's cursor in its compiled grammar (:class:`Matcher`, over xgrammar's
GrammarMatcher) and the packing of bool token masks into xgrammar's bitmask layout."""

from __future__ import annotations

from typing import Any


def pack_bitmask(mask):
    """[V] bool -> [ceil(V / 32)] int32 in xgrammar's bitmask layout."""
    import torch

    words = -(-mask.numel() // 32)
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[:mask.numel()] = mask.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class Matcher:
    """One request's cursor in its grammar."""

    def __init__(self, matcher: Any, xgr: Any, vocab_size: int, extra_mask: Any = None):

        self._m = matcher
        self.vocab_size = vocab_size
        # ANDed with the grammar's bitmask (see json_safe_mask), packed the same way
        self._extra_bits = None if extra_mask is None else pack_bitmask(extra_mask)
        self._xgr = xgr

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` [B, ceil(V / 32)]
        int32 (xgrammar's layout: bit j of word w = token 32 * w + j)."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._extra_bits is not None:
            bitmask[row] &= self._extra_bits

    def allowed_mask(self):
        """[vocab_size] bool tensor of the tokens the grammar allows next."""
        import torch

        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(-1)[:self.vocab_size].bool()

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (state unchanged) if the grammar rejects it."""
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """True once a stop token was accepted in an accepting state: the output is done."""
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        """The string the grammar forces from the current state ("" when there is a choice)."""
        return self._m.find_jump_forward_string()
