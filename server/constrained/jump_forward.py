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
