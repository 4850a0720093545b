"""API speculative execution (SGLang paper §5): matching later primitives against text that one
API call generated past the first ``gen``'s stop.

With ``num_api_spec_tokens=N``, the first unconstrained ``gen`` of a run asks the endpoint for
N tokens without its stop strings. The gen takes the text up to its stop; what follows stays in
a buffer. Each later constant is checked against the buffer and consumed when it matches; each
later gen takes the buffer up to its own stop. Any mismatch drops the buffer and the program
goes on with normal calls, so results never depend on speculation: only the number of calls
(and prompt tokens billed) does. If the speculative call ended with the model's end of
sequence, the last gen may take the rest of the buffer without its stop. These functions are
pure; the interpreter owns the buffer.
"""

from __future__ import annotations


def consume_text(buffer: str, text: str) -> str:
    """The buffer after appending constant ``text``: the rest when it matches ("" when ``text``
    runs past the buffer and agrees with all of it), "" on a mismatch."""
    if buffer.startswith(text):
        return buffer[len(text):]
    return ""


def take_gen(buffer: str, stops: tuple[str, ...], ended: bool = False) -> tuple[str, str] | None:
    """(value, rest of the buffer) for a gen ending at the first of ``stops`` in ``buffer``.
    When no stop occurs: the whole buffer if the speculative call ``ended`` with the model's own
    end of sequence (a real call would end there too), else None (make a real call)."""
    hits = [i for i in (buffer.find(s) for s in stops) if i >= 0]
    if not hits:
        return (buffer, "") if ended and buffer else None
    end = min(hits)
    return buffer[:end], buffer[end:]
