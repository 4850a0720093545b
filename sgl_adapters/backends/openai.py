"""Any OpenAI-compatible endpoint as a backend (the ``openai`` client; the bundled server's
``/v1`` is one), with API speculative execution (SGLang paper §5).

* Completion models (``is_chat_model=False``): the program's whole text is the prompt, and
  ``select`` scores each choice with one echo request (``max_tokens=0, echo=True, logprobs=0``),
  taking the tokens at or after the prompt's end by their ``text_offset``.
* Chat models: completed turns go as ``messages``; a ``gen`` must start an assistant turn (the
  API cannot continue a partial assistant message) and ``select`` generates greedily and picks
  the choice the answer matches best (chat APIs return no prompt logprobs).
* API speculative execution lives in the interpreter
  (:mod:`sgl_adapters.lang.speculative`); this backend only counts what it costs:
  :attr:`OpenAI.usage` has API calls and prompt/completion tokens as billed by the endpoint.

Non-standard sampling fields (top_k, min_p, regex, json_schema, ebnf, ignore_eos, stop_token_ids) go
in ``extra_body``; servers that do not know them ignore them.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from sgl_adapters.backends.base import BackendError, GenCall, GenResult, SelectResult
from sgl_adapters.lang.chat_template import ChatTemplate
from sgl_adapters.lang.choices import choose
from sgl_adapters.lang.ir import SamplingArgs

_EXTRA = ("top_k", "min_p", "regex", "json_schema", "ebnf", "ignore_eos", "stop_token_ids")


@dataclass
class Usage:
    """What the endpoint billed: calls and tokens (prompt tokens as counted by the server)."""

    api_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class OpenAI:
    """Backend for an OpenAI-compatible endpoint.

    Args:
        model: model name sent with each request.
        base_url: e.g. ``http://127.0.0.1:30000/v1``; None = the client's default.
        api_key: None = ``$OPENAI_API_KEY`` (or "EMPTY" for local servers).
        is_chat_model: use ``/chat/completions`` (True) or ``/completions`` (False).
        chat_template: role markers for text prompts of completion models (default: plain).
    """

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool = True, chat_template: ChatTemplate | None = None,
                 timeout: float = 600.0):
        import openai

        self._openai = openai
        self.model, self.is_chat_model = model, is_chat_model
        self.client = openai.OpenAI(base_url=base_url, timeout=timeout, max_retries=0,
                                    api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))
        self._template = chat_template or ChatTemplate.plain()
        self.usage = Usage()
        self._lock = threading.Lock()

    @property
    def chat_template(self) -> ChatTemplate:
        """The role markers given at construction (plain ones by default)."""
        return self._template

    def _count(self, usage: Any) -> None:
        with self._lock:
            self.usage.api_calls += 1
            if usage is not None:
                self.usage.prompt_tokens += usage.prompt_tokens or 0
                self.usage.completion_tokens += usage.completion_tokens or 0

    def _kwargs(self, sp: SamplingArgs) -> dict[str, Any]:
        kw: dict[str, Any] = {"model": sp.lora or self.model}  # a LoRA adapter is a model
        for name in ("max_tokens", "temperature", "top_p", "frequency_penalty",
                     "presence_penalty"):
            if getattr(sp, name) is not None:
                kw[name] = getattr(sp, name)
        if sp.stops():
            kw["stop"] = list(sp.stops())
        extra = {k: getattr(sp, k) for k in _EXTRA if getattr(sp, k) is not None}
        if extra:
            kw["extra_body"] = extra
        return kw

    def _request(self, call: GenCall, **more: Any) -> Any:
        kw = {**self._kwargs(call.sampling), **more}
        try:
            if self.is_chat_model:
                if call.assistant_prefix != "":
                    raise BackendError("a chat model can only generate a whole assistant turn: "
                                       "put gen() first inside s.assistant() (or use a "
                                       "completion model)")
                return self.client.chat.completions.create(messages=list(call.messages), **kw)
            return self.client.completions.create(prompt=call.text, **kw)
        except self._openai.APIStatusError as exc:
            raise BackendError(exc.message, exc.status_code) from exc
        except self._openai.APIError as exc:
            raise BackendError(str(exc)) from exc

    def _text(self, choice: Any) -> str:
        return (choice.message.content or "") if self.is_chat_model else choice.text

    def generate(self, call: GenCall) -> GenResult:
        """One completion (chat or text) of ``call``; usage counted. Raises BackendError."""
        resp = self._request(call)
        self._count(resp.usage)
        choice = resp.choices[0]
        meta = {"finish_reason": choice.finish_reason}
        if resp.usage is not None:
            meta.update(prompt_tokens=resp.usage.prompt_tokens,
                        completion_tokens=resp.usage.completion_tokens)
        return GenResult(self._text(choice), meta)

    def generate_stream(self, call: GenCall) -> Iterator[str | GenResult]:
        """Text deltas as they stream, then the GenResult (usage counted from the final chunk).
        Raises BackendError."""
        stream = self._request(call, stream=True, stream_options={"include_usage": True})
        parts, usage, finish = [], None, None
        try:
            for chunk in stream:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    delta = (c.delta.content or "") if self.is_chat_model else c.text
                    finish = c.finish_reason or finish
                    if delta:
                        parts.append(delta)
                        yield delta
        except self._openai.APIError as exc:
            raise BackendError(str(exc)) from exc
        self._count(usage)
        yield GenResult("".join(parts), {"finish_reason": finish})

    def select(self, call: GenCall, choices: tuple[str, ...], method: str,
               temperature: float = 0.0) -> SelectResult:
        """The choice with the best (normalized) logprob, scored with ``echo`` + ``logprobs``
        on a completions endpoint; a chat model generates an answer and the choice it starts
        with most closely wins ("generate_and_match"). Raises BackendError."""
        if self.is_chat_model:
            return self._select_by_generation(call, choices)
        try:
            resp = self.client.completions.create(
                model=self.model, prompt=[call.text + c for c in choices], max_tokens=0,
                echo=True, logprobs=0)
        except self._openai.APIError as exc:
            raise BackendError(str(exc)) from exc
        self._count(resp.usage)
        cut = len(call.text)
        logprobs = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            lp = choice.logprobs
            logprobs.append([x for tok, off, x in zip(lp.tokens, lp.text_offset, lp.token_logprobs)
                             if off + len(tok) > cut and x is not None])
        index, scores = choose("greedy" if method == "greedy" else "token_length_normalized",
                               logprobs, temperature=temperature)
        return SelectResult(choices[index], {"method": method, "normalized_prompt_logprobs": scores,
                                             "input_token_logprobs": logprobs})

    def _select_by_generation(self, call: GenCall, choices: tuple[str, ...]) -> SelectResult:
        longest = max(len(c) for c in choices)
        sp = SamplingArgs(max_tokens=max(1, longest), temperature=0.0)
        answer = self.generate(GenCall(call.text, sp, call.messages, call.images, "")).text

        said = answer.strip().lower()

        def overlap(c: str) -> int:
            n = 0
            while n < min(len(c), len(said)) and c[n].lower() == said[n]:
                n += 1
            return n

        best = max(range(len(choices)), key=lambda i: overlap(choices[i]))
        return SelectResult(choices[best], {"method": "generate_and_match", "answer": answer})

    def cache_prefix(self, text: str) -> None:
        """No-op: a generic endpoint has no cache hint."""

    def shutdown(self) -> None:
        """Close the HTTP client."""
        self.client.close()
