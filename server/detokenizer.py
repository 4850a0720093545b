"""Incremental, UTF-8-safe detokenization and stop strings across token boundaries.

Decoding each new token on its own breaks multi-byte characters split over several byte-level
BPE tokens and loses the leading-space rules of SentencePiece tokenizers. The classic fix (used by
TGI, vLLM and SGLang) decodes a short window of ids twice — with and without the new ones — and
emits the difference, holding back while the window ends in an incomplete character (U+FFFD).

Stop strings are searched in the text produced so far; the text is cut before the first match.
For streaming, :attr:`IncrementalDetokenizer.stream_safe_text` holds back a tail that could still
become a stop string, so text that was sent is never taken back.
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Args:
        tokenizer: a transformers tokenizer (``decode`` is the only method used).
        prompt_ids: the prompt; its last few tokens seed the window so the first output token
            decodes with the right leading space.
        stop: stop strings (may span tokens).
        skip_special_tokens: drop special tokens (EOS, role markers) from the text.
    """

    WINDOW = 5  # tokens of context kept before the unread tail

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_ids[-self.WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.matched_stop: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one output token; return the newly readable text (may be "").

        After a stop string matched, :attr:`text` ends just before it, :attr:`matched_stop` is
        set, and further calls return "".
        """
        if self.matched_stop is not None:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if full_text.endswith(_REPLACEMENT) or len(full_text) < len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        new = full_text[len(prefix_text):]
        self._prefix_offset = max(self._read_offset, len(self._ids) - self.WINDOW)
        self._read_offset = len(self._ids)
        if self._prefix_offset > 64:  # keep the id list short
            drop = self._prefix_offset
            self._ids = self._ids[drop:]
            self._prefix_offset -= drop
            self._read_offset -= drop
        before = len(self.text)
        self.text += new
        if self.stop:
            self._check_stop(before, len(new))
        return self.text[before:]

    def _check_stop(self, before: int, added: int) -> None:
        start = max(0, before - self._max_stop + 1)
        best = None
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            self.text = self.text[:best[0]]
            self.matched_stop = best[1]

    @property
    def stream_safe_text(self) -> str:
        """:attr:`text` minus a tail that is a proper prefix of some stop string."""
        if self.matched_stop is not None or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[:len(self.text) - hold]
