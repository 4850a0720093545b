"""A grammar held back while a reasoning model thinks (see :mod:`server.reasoning`).

:class:`ReasoningGatedMatcher` has the interface of :class:`server.constrained.matcher.Matcher`
and three states:

* maybe: the first token may open a think block: the allowed set is the grammar's plus the
  start token; taking it enters reasoning, taking anything else hands over to the grammar;
* reasoning: every token is allowed and the grammar does not move; once the output ends with
  the end marker's ids the grammar applies;
* active: the grammar decides, as for any constrained request (jump-forward included).

As SGLang's ``ReasonerGrammarBackend`` does, the grammar is compiled and matched on the answer
alone, so a thinking model still returns valid JSON, regex matches and tool calls.
"""

from __future__ import annotations

from typing import Any

MAYBE, REASONING, ACTIVE = "maybe", "reasoning", "active"


class ReasoningGatedMatcher:
    """Args: matcher (a grammar Matcher); end_ids: token ids that end the reasoning;
    in_reasoning: the output starts inside the think block; start_id: the token that opens
    one (then the first token decides), or None."""

    def __init__(self, matcher: Any, end_ids: list[int], in_reasoning: bool,
                 start_id: int | None = None):
        self._m = matcher
        self.end_ids = list(end_ids)
        self.start_id = start_id
        self.state = REASONING if in_reasoning else MAYBE if start_id is not None else ACTIVE
        self._tail: list[int] = []  # the last len(end_ids) tokens seen while reasoning

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Allowed next tokens into row ``row`` of the int32 bitmask [B, ceil(V / 32)]."""
        if self.state == REASONING:
            bitmask[row] = -1  # every bit set: anything goes while thinking
            return
        self._m.fill_bitmask(bitmask, row)
        if self.state == MAYBE:
            word, bit = divmod(self.start_id, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (the state is left as it was)."""
        if self.state == REASONING or (self.state == MAYBE and token_id == self.start_id):
            return True
        return self._m.allows(token_id)

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (state unchanged) if the grammar rejects it."""
        if self.state == MAYBE:
            if token_id == self.start_id:
                self.state = REASONING
                return True
            if not self._m.accept(token_id):
                return False
            self.state = ACTIVE
            return True
        if self.state == REASONING:
            self._tail = (self._tail + [token_id])[-len(self.end_ids):]
            if self._tail == self.end_ids:
                self.state = ACTIVE
            return True
        return self._m.accept(token_id)

    @property
    def drafts_allowed(self) -> bool:
        """Drafts may be checked against the grammar only once it applies (rollback undoes
        grammar tokens, not the thinking)."""
        return self.state == ACTIVE

    @property
    def terminated(self) -> bool:
        """The grammar is active and has reached its end (nothing more may be generated)."""
        return self.state == ACTIVE and self._m.terminated

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` grammar tokens (drafts are made only once active)."""
        self._m.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        """The string the grammar forces next; "" before it applies."""
        return self._m.jump_forward_string() if self.state == ACTIVE else ""

    def allowed_mask(self):
        """[vocab_size] bool tensor of the tokens allowed next."""
        import torch

        if self.state == REASONING:
            return torch.ones(self._m.vocab_size, dtype=torch.bool)
        mask = self._m.allowed_mask()
        if self.state == MAYBE:
            mask[self.start_id] = True
        return mask
