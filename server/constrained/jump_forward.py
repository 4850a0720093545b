"""Jump-forward decoding over the compressed FSM (SGLang paper §4, Appendix B), verified.

When the grammar allows exactly one continuation string from the current state (a chain of
singular FSM transitions compressed into one edge), that string need not be decoded one forward
pass per token. SGLang appends it at once and re-tokenizes the boundary; that changes the
tokenization the model sees, so outputs differ from plain decoding (and boundary bugs led SGLang
to drop the feature: sglang#2045, #4032).

Here the forced string is a *draft*, as in speculative decoding with the grammar as the draft
model: its tokens are appended after the model's own last token and computed in one extend pass
that returns logits at every draft position; the scheduler then samples each position exactly as
plain decoding would (same mask, penalties and per-request RNG, one draw per token) and keeps
drafts while they equal the sample. The first mismatch is replaced by the model's own choice,
and the KV of rejected drafts is freed. So outputs are identical to decoding with jump-forward
off, by construction, while a forced run costs one forward pass instead of one per token.

Draft checks: the tokens must decode back to exactly the forced text after the last token (the
UTF-8 / boundary round trip), and the grammar must accept every one of them (it is restored).

A draft holds at most ``MAX_DRAFT_TOKENS``, tokenized from the forced string's first
``MAX_DRAFT_CHARS`` characters: a long forced string (a 30,000-character enum value, ``a{1000000}``)
is drafted a piece at a time, so neither the tokenizer nor a verify pass works on the whole of it
every step when the model keeps rejecting it.
"""

from __future__ import annotations

from typing import Any

MAX_DRAFT_TOKENS = 32
MAX_DRAFT_CHARS = 16 * MAX_DRAFT_TOKENS  # tokens rarely span more characters than this


def draft_tokens(matcher: Any, tokenizer: Any, last_token: int, max_tokens: int) -> list[int]:
    """Up to ``max_tokens`` (at most MAX_DRAFT_TOKENS) tokens of the string the grammar forces
    after ``last_token`` (which the matcher has accepted); [] when nothing is forced or a check
    fails. The matcher is left exactly as it was."""
    max_tokens = min(max_tokens, MAX_DRAFT_TOKENS)
    if max_tokens <= 0:
        return []
    try:
        forced = matcher.jump_forward_string()
    except UnicodeDecodeError:  # the forced bytes end inside a multi-byte character
        return []
    if not forced:
        return []
    ids = tokenizer.encode(forced[:MAX_DRAFT_CHARS], add_special_tokens=False)
    if len(forced) > MAX_DRAFT_CHARS:
        ids = ids[:-1]  # the cut may have split what would be one token of the whole string
    ids = ids[:max_tokens]
    last = tokenizer.decode([last_token], skip_special_tokens=False)
    full = tokenizer.decode([last_token] + ids, skip_special_tokens=False)
    if not forced.startswith(full[len(last):]) or not full.startswith(last):
        return []
    return accepted_prefix(matcher, ids)


def accepted_prefix(matcher: Any, ids: list[int]) -> list[int]:
    """The longest prefix of draft ``ids`` the grammar accepts from its current state (the
    matcher is left exactly as it was); [] while the grammar is held back (a reasoning model
    thinking: ``drafts_allowed`` False)."""
    if not getattr(matcher, "drafts_allowed", True):
        return []
    accepted = 0
    for t in ids:
        if not matcher.accept(t):
            break
        accepted += 1
    matcher.rollback(accepted)
    return ids[:accepted]


class ForcedTokenizer:
    """The tokenizer that drafts forced strings, learning where the model splits its tokens.

    A forced string's canonical tokenization (``tokenizer.encode``) is not always the one the
    model produces: SmolLM2 writes the opening of a JSON array as ``' ['`` then ``'"'`` where
    the tokenizer has the single token ``' ["'``, so a draft holding ``' ["'`` is rejected at that
    token every time and the forced run costs one more pass (22 of 40 rejected drafts in
    ``benchmarks.json_decode``). Each verify pass tells which: a rejected draft token whose text
    starts with the text of the token the model chose instead is a *split* (the model's token,
    then the rest re-encoded); a chosen token whose text starts with the rejected draft token's
    is a vote for the longer token. A draft token is replaced by its split while the model chose
    the split more often than the token itself (accepted drafts are votes for it). Drafts are
    still verified, so a wrong guess costs a pass, never an output.

    Args: tokenizer (a HF tokenizer: ``encode``, ``decode``). A fast tokenizer's Rust
    backend (``backend_tokenizer``) is called directly where its ids and text equal the HF
    wrapper's (no ``clean_up_tokenization_spaces``): the wrapper's own bookkeeping took ~15 us
    an encode against ~5, for every draft.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) \
            else backend
        # token -> [times the model chose it, times it chose its split, the split's ids]
        self._votes: dict[int, list] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``tokenizer.encode(text)`` with each token the model is known to split replaced
        by its split."""
        ids = (self._backend.encode(text, add_special_tokens=add_special_tokens).ids
               if self._backend is not None
               else self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if not self._votes:
            return ids
        out: list[int] = []
        for t in ids:
            v = self._votes.get(t)
            out.extend(v[2] if v is not None and v[1] > v[0] else (t,))
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """``tokenizer.decode``."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def observe(self, drafts: list[int], produced: list[int]) -> None:
        """A verify pass of ``drafts`` produced ``produced`` (the accepted drafts, then the
        model's own token)."""
        for d, p in zip(drafts, produced):
            if d == p:
                self._votes.setdefault(d, [0, 0, None])[0] += 1
                continue
            d_text, p_text = self.decode([d]), self.decode([p])
            if "\ufffd" in d_text + p_text:  # part of a multi-byte character
                return
            if len(p_text) < len(d_text) and d_text.startswith(p_text):
                split = [p] + self.tokenizer.encode(d_text[len(p_text):], add_special_tokens=False)
                if self.decode(split) == d_text:
                    v = self._votes.setdefault(d, [0, 0, None])
                    v[1], v[2] = v[1] + 1, split
            elif len(d_text) < len(p_text) and p_text.startswith(d_text):
                v = self._votes.get(p)  # the model merged what a split drafted
                if v is not None:
                    v[0] += 1
            return
