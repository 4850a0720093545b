"""Incremental, UTF-8-safe detokenization and stop strings across token boundaries, done by
the front ends (the HTTP process's tokenizer manager, and :class:`server.engine.Engine` for
in-process use), never by the scheduler, which sends token ids only.

Decoding each new token on its own breaks multi-byte characters split over several byte-level
BPE tokens and loses the leading-space rules of SentencePiece tokenizers. With a fast (Rust)
tokenizer, ``tokenizers.decoders.DecodeStream`` does it in one call per token, prefilled with
the prompt's last tokens. Otherwise the classic method (TGI, vLLM, SGLang) decodes a short
window of ids twice — with and without the new ones — and emits the difference, holding back
while the window ends in an incomplete character (U+FFFD).

Stop strings are searched in the text produced so far; the text is cut before the first match
(after it with ``no_stop_trim``). For streaming, :attr:`IncrementalDetokenizer.stream_safe_text`
holds back a tail that could still become a stop string, so text that was sent is never taken
back. Stop regexes (SGLang's ``stop_regex``) are searched in the last ``REGEX_WINDOW``
characters; a streamed text holds nothing back for them (a regex may match text of any length),
so a match that starts in text already sent ends the stream there without taking it back.
A stop regex is a client's program run on every new token: it runs on the ``regex`` module
with a time limit (``STOP_REGEX_TIMEOUT_S`` per search), so a pattern that backtracks
catastrophically (``(a|aa)+c``) ends its own request with an error instead of freezing the
process that searches it (the HTTP event loop).
"""

from __future__ import annotations

from typing import Any, Sequence

import regex

STOP_REGEX_TIMEOUT_S = 0.02  # per search of the last REGEX_WINDOW characters (a few us is typical)


class StopRegexTimeout(ValueError):
    """A stop regex took over STOP_REGEX_TIMEOUT_S to search; the message names it."""

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Args:
        tokenizer: a transformers tokenizer (a fast one's Rust tokenizer is used directly).
        prompt_ids: the prompt; its last few tokens seed the decoder so the first output token
            decodes with the right leading space.
        stop: stop strings (may span tokens).
        skip_special_tokens: drop special tokens (EOS, role markers) from the text.
    """

    WINDOW = 5  # tokens of prompt context
    REGEX_WINDOW = 1024  # characters searched for a stop regex

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, stop_regex: Sequence[str] = (),
                 no_stop_trim: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stop_regex = tuple(regex.compile(p) for p in stop_regex)
        self.no_stop_trim = no_stop_trim
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_ids[-self.WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stream = self._rust = None
        rust = getattr(tokenizer, "_tokenizer", None)
        if rust is not None:
            from tokenizers import Tokenizer
            from tokenizers.decoders import DecodeStream

            if isinstance(rust, Tokenizer):
                self._rust = rust
                self._stream = DecodeStream(list(self._ids), skip_special_tokens)
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
        new = self._next_text(token_id)
        if not new:
            return ""
        before = len(self.text)
        self.text += new
        if self.stop or self.stop_regex:
            self._check_stop(before)
        return self.text[before:]

    def _next_text(self, token_id: int) -> str:
        if self._stream is not None:
            return self._stream.step(self._rust, token_id) or ""
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
        return new

    def _check_stop(self, before: int) -> None:
        start = max(0, before - self._max_stop + 1)
        best = None  # (start, end, matched text)
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, pos + len(s), s)
        window = max(0, len(self.text) - self.REGEX_WINDOW)
        for pattern in self.stop_regex:
            try:
                m = pattern.search(self.text, window, timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError as exc:
                raise StopRegexTimeout(
                    f"stop_regex {pattern.pattern!r} took over {STOP_REGEX_TIMEOUT_S * 1e3:.0f} "
                    f"ms to search {len(self.text) - window} characters of output (a pattern "
                    "that backtracks catastrophically, like '(a|aa)+c'); simplify it") from exc
            if m is not None and m.end() > before and (best is None or m.start() < best[0]):
                best = (m.start(), m.end(), m.group(0))
        if best is not None:
            self.text = self.text[:best[1] if self.no_stop_trim else best[0]]
            self.matched_stop = best[2]

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


class OutputText:
    """One request's output as a client sees it, built from the scheduler's token-id deltas.

    Args:
        tokenizer, prompt_ids: as for :class:`IncrementalDetokenizer`.
        stop, skip_special_tokens, stop_regex, no_stop_trim: as in SamplingParams.

    :meth:`feed` takes each step's new ids and the scheduler's finish reason. A stop token
    (EOS, a stop id, a grammar's end) is counted but not shown; a stop string ends the output
    at the token that completed it: :attr:`num_tokens` counts up to that token, and the caller
    must abort the request in the scheduler, which does not look at text.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, stop_regex: Sequence[str] = (),
                 no_stop_trim: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop,
                                                  skip_special_tokens, stop_regex, no_stop_trim)
        self.num_tokens = 0  # output tokens kept
        self.finish_reason: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The text so far (final once :attr:`finish_reason` is set)."""
        return self.detokenizer.text

    @property
    def stream_text(self) -> str:
        """What may be sent to a streaming client now (never taken back later)."""
        return self.detokenizer.stream_safe_text

    def feed(self, new_ids: Sequence[int], finish_reason: dict[str, Any] | None) -> int:
        """Consume one delta; returns how many of ``new_ids`` are kept (all, unless a stop
        string matched; then :attr:`finish_reason` is ``{"type": "stop", "matched": str}``).
        Nothing is kept once finished. Raises StopRegexTimeout (the request cannot go on: its
        caller ends it with a 400 naming the pattern)."""
        if self.finish_reason is not None:
            return 0
        stop_token = (finish_reason is not None and finish_reason.get("type") == "stop"
                      and isinstance(finish_reason.get("matched"), int))
        for k, tok in enumerate(new_ids):
            if not (stop_token and k == len(new_ids) - 1):
                self.detokenizer.append(tok)
            if self.detokenizer.matched_stop is not None:
                self.num_tokens += k + 1
                self.finish_reason = {"type": "stop", "matched": self.detokenizer.matched_stop}
                return k + 1
        self.num_tokens += len(new_ids)
        self.finish_reason = finish_reason
        return len(new_ids)
