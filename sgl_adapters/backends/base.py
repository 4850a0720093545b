"""The Backend protocol: what the interpreter asks of a model server.

A backend gets plain data (:class:`GenCall`), never a program state, so backends are testable
alone and the interpreter never knows which server it talks to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

from sgl_adapters.lang.chat_template import ChatTemplate
from sgl_adapters.lang.ir import SamplingArgs


class BackendError(RuntimeError):
    """A request failed on the server (HTTP status and message) or could not reach it."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message if status is None else f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class GenCall:
    """One generation request. ``text`` is the whole prompt so far (the server's radix cache
    finds the shared prefix); ``messages`` is the same prompt as chat turns for chat-only
    endpoints; ``images`` are the images appended so far; ``assistant_prefix`` is the text of
    the open assistant turn before this gen (None outside an assistant turn); ``priority``:
    how many calls its program made before it (a server that schedules by priority admits a
    program's later calls before new programs' first ones, finishing programs sooner)."""

    text: str
    sampling: SamplingArgs
    messages: tuple[dict[str, str], ...] = ()
    images: tuple[Any, ...] = ()
    assistant_prefix: str | None = None
    priority: int = 0


@dataclass
class GenResult:
    """Generated text and its meta info (server fields: prompt_tokens, completion_tokens,
    cached_tokens, finish_reason, logprobs when asked)."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SelectResult:
    """The chosen choice and its scores (meta: normalized_prompt_logprobs [per choice],
    input_token_logprobs [per choice, list of (logprob, token_id)], method)."""

    choice: str
    meta: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """What the interpreter needs. ``is_chat_model``: prompts must be sent as messages (no raw
    text continuation); ``chat_template``: role markers for text prompts."""

    is_chat_model: bool

    @property
    def chat_template(self) -> ChatTemplate:
        """The role markers text prompts are rendered with."""
        ...

    def generate(self, call: GenCall) -> GenResult:
        """Raises BackendError."""

    def generate_stream(self, call: GenCall) -> Iterator[str | GenResult]:
        """Yields text chunks, then one final GenResult with the whole text and meta info.
        Raises BackendError."""

    def select(self, call: GenCall, choices: tuple[str, ...], method: str) -> SelectResult:
        """Score ``call.text + choice`` for each choice. Raises BackendError."""

    def cache_prefix(self, text: str) -> None:
        """Hint: compute and cache ``text`` now (a prefill-only request); no-op if unsupported."""

    def shutdown(self) -> None:
        """Close connections (and stop a server this backend started)."""
        ...
