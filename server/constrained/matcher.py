"""One request's cursor in its compiled grammar (:class:`Matcher`, over xgrammar's
GrammarMatcher) and the packing of bool token masks into xgrammar's bitmask layout."""

from __future__ import annotations

from typing import Any, Sequence

_MAX_TRAIL = 256  # accepted tokens a rollback may undo with the cache kept (drafts are <= 33)


def pack_bitmask(mask):
    """[V] bool -> [ceil(V / 32)] int32 in xgrammar's bitmask layout."""
    import torch

    words = -(-mask.numel() // 32)
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[:mask.numel()] = mask.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class PackedMask:
    """A [V] bool token mask held two ways, built once per grammar kind and shared by its
    matchers: ``bits`` ([ceil(V / 32)] int32, :func:`pack_bitmask`) to AND into a bitmask row,
    and ``flags`` (V bytes, 1 = allowed) for one token's lookup: a bytes index costs ~50 ns
    where reading a word of ``bits`` as a Python int cost ~1 us, and constrained decoding asks
    about a token several times a row (:meth:`Matcher.allows`)."""

    def __init__(self, mask):
        self.bits = pack_bitmask(mask)
        self.flags = mask.to("cpu").numpy().astype("uint8").tobytes()

    def allows(self, token_id: int) -> bool:
        """Whether the mask keeps ``token_id`` (an id past the mask's size: False)."""
        return token_id < len(self.flags) and self.flags[token_id] == 1


class Matcher:
    """One request's cursor in its grammar.

    Args: matcher (xgrammar GrammarMatcher), xgr (the module), vocab_size, extra_mask (a
    :class:`PackedMask` ANDed with the grammar's mask, or None), token_bytes (each token id's
    bytes, xgrammar's ``TokenizerInfo.decoded_vocab``; empty: no forced-string cache),
    after_ed (a :class:`PackedMask` ANDed with the mask while the accepted bytes end in the
    UTF-8 lead byte ED, or None; see ``GrammarCompiler.utf8_masks``: it keeps xgrammar from
    completing a surrogate).

    The forced string of a state is kept and walked as tokens are accepted (and restored on
    rollback): while accepted tokens spell its prefix, the forced string of the new state is
    its rest, so :meth:`jump_forward_string` does not ask xgrammar again. xgrammar builds the
    whole string per call: 160-300 ms for ``a{1000000}``, every decode step of such a request.
    """

    def __init__(self, matcher: Any, xgr: Any, vocab_size: int,
                 extra_mask: PackedMask | None = None, token_bytes: Sequence[bytes] = (),
                 after_ed: PackedMask | None = None):
        self._m = matcher
        self.vocab_size = vocab_size
        self._extra = extra_mask  # ANDed with the grammar's bitmask (see json_safe_mask)
        self._after_ed = after_ed
        self._xgr = xgr
        self._token_bytes = token_bytes
        self._ends_in_ed = False  # the last accepted byte is ED (needs token_bytes)
        self._forced = b""  # a forced string (UTF-8) of an earlier state ...
        self._pos: int | None = None  # ... of which the current state has consumed this much
        # (_forced, _pos, _ends_in_ed) before each accepted token, for rollback
        self._trail: list[tuple[bytes, int | None, bool]] = []

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` [B, ceil(V / 32)]
        int32 (xgrammar's layout: bit j of word w = token 32 * w + j)."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._extra is not None:
            bitmask[row] &= self._extra.bits
        if self._ends_in_ed and self._after_ed is not None:
            bitmask[row] &= self._after_ed.bits

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next: the bit :meth:`fill_bitmask` would set for it
        (grammar and extra mask), asked by accepting it and rolling back (a few microseconds
        against ~0.2 ms for a whole 49k-token bitmask). The state is left as it was."""
        if not 0 <= token_id < self.vocab_size:
            return False
        if self._extra is not None and not self._extra.allows(token_id):
            return False
        if self._ends_in_ed and self._after_ed is not None and not self._after_ed.allows(token_id):
            return False
        if not self._m.accept_token(token_id):
            return False
        self._m.rollback(1)
        return True

    def allowed_mask(self):
        """[vocab_size] bool tensor of the tokens the grammar allows next."""
        import torch

        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(-1)[:self.vocab_size].bool()

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (state unchanged) if the grammar rejects it."""
        if not self._m.accept_token(token_id):
            return False
        self._trail.append((self._forced, self._pos, self._ends_in_ed))
        if len(self._trail) > _MAX_TRAIL:
            del self._trail[:-_MAX_TRAIL // 2]
        b = self._token_bytes[token_id] if token_id < len(self._token_bytes) else b""
        if b:
            self._ends_in_ed = b[-1] == 0xED
        if self._pos is not None:
            forced_prefix = b and self._forced.startswith(b, self._pos)
            self._pos = self._pos + len(b) if forced_prefix else None
        return True

    @property
    def terminated(self) -> bool:
        """True once a stop token was accepted in an accepting state: the output is done."""
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)
            if num_tokens <= len(self._trail):
                self._forced, self._pos, self._ends_in_ed = self._trail[-num_tokens]
                del self._trail[-num_tokens:]
            else:  # past the trail the last byte is unknown: xgrammar alone decides
                self._pos, self._trail, self._ends_in_ed = None, [], False

    def jump_forward_string(self) -> str:
        """The string the grammar forces from the current state ("" when there is a choice).
        Raises UnicodeDecodeError when it ends inside a multi-byte character."""
        if self._pos is None or self._pos >= len(self._forced):
            forced = self._m.find_jump_forward_string()
            self._forced, self._pos = forced.encode("utf-8"), 0
            return forced
        return self._forced[self._pos:].decode("utf-8")
