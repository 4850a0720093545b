"""Reasoning models (Qwen3, DeepSeek-R1 style): the thinking between ``<think>`` and
``</think>`` is returned apart from the answer, and a grammar applies to the answer only.

Where a request starts is read from the end of its prompt, so one parser serves every
template convention:

* the prompt ends inside an open ``<think>`` (DeepSeek-R1's and Qwen3-Thinking's templates open
  it for the model): the output starts in reasoning ("reasoning");
* the prompt ends with a closed, empty think block (Qwen3 with ``enable_thinking=False``):
  there is no reasoning ("off");
* otherwise the model may open one itself as its first token (Qwen3's default): "maybe".

The HTTP process splits the text (:func:`split`, and :class:`ReasoningStream` for SSE deltas,
which holds back a tail that may still become a marker); the scheduler gates the grammar with
the token ids in :class:`server.protocol.ReasoningGate` (:mod:`server.constrained.reasoning_gate`).
The convention follows SGLang's ``--reasoning-parser`` (``reasoning_content`` in OpenAI chat
responses, as DeepSeek's API returns it). Torch-free: it runs in the HTTP process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server import protocol as P
from server.front_config import REASONING_PARSERS

START, END = "<think>", "</think>"


class ReasoningParserError(ValueError):
    """A named reasoning parser does not fit the model's tokenizer."""


@dataclass(frozen=True)
class ReasoningParser:
    """The think markers and their token ids in one tokenizer.

    Attributes:
        start_id: the id of ``<think>`` when it is one token (None otherwise: then a model
            that might open a think block gets its grammar from the first token).
        end_ids: the ids of ``</think>`` (usually one special token).
    """

    start_id: int | None
    end_ids: tuple[int, ...]

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> "ReasoningParser | None":
        """The parser ``name`` (see REASONING_PARSERS) for ``tokenizer``; None for "none", and
        for "auto" unless the chat template uses ``<think>``/``</think>`` and both are single
        tokens (unambiguous). Raises ReasoningParserError for a named parser whose markers the
        tokenizer does not have as tokens, ValueError for an unknown name."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {name!r}")
        if name == "none":
            return None
        start = tokenizer.encode(START, add_special_tokens=False)
        end = tokenizer.encode(END, add_special_tokens=False)
        single = len(start) == 1 and len(end) == 1
        if name == "auto":
            template = getattr(tokenizer, "chat_template", None) or ""
            if not (single and START in template and END in template):
                return None
        elif len(end) != 1:
            raise ReasoningParserError(
                f"reasoning parser {name!r}: {END!r} is not one token in this tokenizer")
        return cls(start[0] if len(start) == 1 else None, tuple(end))

    def prompt_state(self, prompt_tail: str) -> str:
        """"reasoning", "off" or "maybe" (module docstring) from the last characters of the
        rendered prompt."""
        tail = prompt_tail.rstrip()
        if tail.endswith(START):
            return "reasoning"
        if tail.endswith(END):
            return "off"
        return "maybe"

    def gate(self, state: str) -> P.ReasoningGate | None:
        """What the scheduler needs to hold a grammar back until the reasoning ends; None when
        the grammar applies from the first token."""
        if state == "reasoning":
            return P.ReasoningGate(start_id=None, end_ids=list(self.end_ids), in_reasoning=True)
        if state == "maybe" and self.start_id is not None:
            return P.ReasoningGate(start_id=self.start_id, end_ids=list(self.end_ids),
                                   in_reasoning=False)
        return None


def split(text: str, state: str, final: bool = True) -> tuple[str | None, str]:
    """(reasoning or None, answer) of an output ``text`` that began in ``state``.

    Thinking cut off before ``</think>`` (a length limit) is all reasoning. With ``final``
    False, a tail that may still become a marker is held back from both parts, so successive
    calls on a growing text give growing parts."""
    if state == "off":
        return None, text
    body = text
    if state == "maybe":
        lead = text.lstrip()
        if not final and START.startswith(lead) and lead != START:
            return None, ""  # may still open a think block
        if not lead.startswith(START):
            return None, text
        body = lead[len(START):]
    end = body.find(END)
    if end < 0:
        hold = 0 if final else _partial_marker(body, END)
        return body[:len(body) - hold].lstrip(), ""
    return body[:end].strip(), body[end + len(END):].lstrip()


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """Streaming deltas of the two parts: ``feed(cumulative text)`` -> (reasoning delta,
    answer delta), each "" when nothing new is known; ``final=True`` (the last output)
    releases held-back text."""

    def __init__(self, state: str):
        self.state = state
        self.sent_reasoning = ""
        self.sent_answer = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, answer) text not sent yet, given the whole output ``text`` so far;
        ``final`` releases text held back while a marker could still be forming."""
        reasoning, answer = split(text, self.state, final)
        # the reasoning part may lose trailing whitespace once the marker arrives (strip):
        # deltas only ever extend what was sent
        reasoning = reasoning or ""
        if reasoning.startswith(self.sent_reasoning):
            r_delta = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        else:
            r_delta = ""
        a_delta = answer[len(self.sent_answer):] if answer.startswith(self.sent_answer) else ""
        self.sent_answer = answer if answer.startswith(self.sent_answer) else self.sent_answer
        return r_delta, a_delta
