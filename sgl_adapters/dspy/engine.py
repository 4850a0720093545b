"""The DSPy 3.4 engine for the bundled server (``complete(Request) -> Response``, ``stream``,
``close``, and an async twin), as DSPy's custom-engine contract defines it
(``dspy/clients/engines/base.py``): one request in, one response out; DSPy owns caching,
retries, candidate fan-out (``n``), history and callbacks.

ChatAdapter-shaped requests are lowered into programs of the language
(:mod:`sgl_adapters.dspy.lowering`) and run over the native API; everything else (or every
request, with ``lowering=False``) goes to the server's OpenAI route with the ``openai`` client,
which enforces JSONAdapter's ``response_format`` schemas and tool calls with its grammar.
Either way the prompt's prefix up to the last user turn (instructions, field skeleton, demos)
is hinted once per distinct prefix, so a batch computes it once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Iterator

from dspy.lm15 import (
    InvalidRequestError,
    Message,
    Response,
    ServerError,
    StreamDeltaEvent,
    StreamEndEvent,
    StreamStartEvent,
    TextDelta,
    TextPart,
    TokenLogprob,
    ToolCallPart,
    TopLogprob,
    TransportError,
    Usage,
    response_to_events,
)

import sgl_adapters as sgl
from sgl_adapters.dspy.lowering import lowered_program, plan_fields
from sgl_adapters.lang.hints import PrefixHints

# When a call sets no max_tokens (DSPy 3.4's ``dspy.LM`` sets none and leaves it to the
# provider; our server's own default would be the rest of the context): a lowered call bounds
# each str/JSON field by FIELD_MAX_TOKENS, a chat-route call its whole answer by
# DEFAULT_MAX_TOKENS (tokens; LangChain's ChatAnthropic default, and ChatSGLang's).
FIELD_MAX_TOKENS = 256
DEFAULT_MAX_TOKENS = 1024
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_call", "abort": "error"}


def _text_of(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    parts = [getattr(p, "text", None) for p in content]
    return None if any(t is None for t in parts) else "".join(parts)


def _turns(request) -> list[tuple[str, str]] | None:
    """(role, text) of each message, or None if a message is not plain text."""
    turns = []
    for m in request.messages:
        text = m.text
        if m.role not in ("user", "assistant") or text is None or len(m.parts) != 1:
            return None
        turns.append((m.role, text))
    return turns


class SGLangEngine:
    """Sync engine. Args: ``base_url`` of the bundled server (no ``/v1``), ``api_key``,
    ``model`` (the served model name, or a LoRA adapter's: every call runs on it),
    ``lowering`` (ChatAdapter calls as programs), ``timeout`` (seconds per HTTP request).
    Errors become dspy.lm15 errors (4xx -> InvalidRequestError, 5xx -> ServerError,
    unreachable -> TransportError)."""

    supports_function_calling = True
    supports_response_schema = True
    supports_reasoning = False
    supported_params = frozenset({"response_format", "tools", "tool_choice", "logprobs",
                                  "top_logprobs", "seed", "stop", "top_k"})

    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None,
                 model: str = "default", lowering: bool = True, timeout: float = 600.0):
        import openai

        self.base_url, self.model, self.lowering = base_url.rstrip("/"), model, lowering
        self._api_key, self.timeout = api_key, timeout
        # a LoRA adapter's name as model: the lowered programs run on it too (lora_path)
        self.backend = sgl.RuntimeEndpoint(self.base_url, api_key=api_key, timeout=timeout,
                                           model=model)
        self.hints = PrefixHints(self.backend)
        self._openai = openai
        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key or "EMPTY",
                                    timeout=timeout, max_retries=0)

    # -- persistence (dspy saves the engine's class path and this state; never the key) ---------
    def dump_state(self) -> dict[str, Any]:
        """What DSPy saves of this engine (never the API key)."""
        return {"base_url": self.base_url, "model": self.model, "lowering": self.lowering,
                "timeout": self.timeout}

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> SGLangEngine:
        """The engine :meth:`dump_state` described."""
        return cls(**state)

    # -- contract ------------------------------------------------------------------------------
    def complete(self, request) -> Response:
        """DSPy's engine contract: one request, one response; a ChatAdapter request runs as
        a lowered program, anything else on the OpenAI route. Raises dspy.lm15 errors."""
        try:
            plan = self._plan(request)
            if plan is not None:
                return self._run_lowered(request, *plan)
            return self._chat(request)
        except sgl.BackendError as exc:  # the chat template, a prefix hint: same mapping
            raise _lm15_error(exc) from exc

    def stream(self, request) -> Iterator:
        """The response as dspy.lm15 stream events (a lowered program's text as it is
        generated, its markers included). Raises dspy.lm15 errors."""
        try:
            yield from self._stream(request)
        except sgl.BackendError as exc:
            raise _lm15_error(exc) from exc

    def _stream(self, request) -> Iterator:
        plan = self._plan(request)
        if plan is None:
            yield from response_to_events(self._chat(request))
            return
        system, turns, fields = plan
        yield StreamStartEvent(id=None, model=self.model)
        state = self._start(request, system, turns, fields, stream=True)
        t = self.backend.chat_template
        skip = len(t.render([("system", system), *turns]) + t.prefix("assistant"))
        hold = len(t.suffix("assistant"))  # the turn's closing marker is not content
        text, sent = "", 0
        for chunk in state.text_iter():
            text += chunk
            ready = len(text) - skip - hold
            if ready > sent:
                yield StreamDeltaEvent(delta=TextDelta(text=text[skip + sent:skip + ready]))
                sent = ready
        response = self._response(state)
        rest = response.text[sent:]
        if rest:
            yield StreamDeltaEvent(delta=TextDelta(text=rest))
        yield StreamEndEvent(finish_reason=response.finish_reason, usage=response.usage)

    def close(self) -> None:
        """Close both HTTP clients."""
        self.backend.shutdown()
        self.client.close()

    # -- lowering ------------------------------------------------------------------------------
    def _plan(self, request):
        if not self.lowering or request.tools or request.config.response_format is not None:
            return None
        system = _text_of(request.system)
        turns = _turns(request)
        if system is None or not turns or turns[-1][0] != "user":
            return None
        fields = plan_fields(system, turns[-1][1])
        return None if fields is None else (system, turns, fields)

    def _start(self, request, system, turns, fields, stream: bool):
        cfg = request.config
        self.hints.ensure(self.backend.chat_template.render([("system", system), *turns[:-1]]))
        sampling = {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k", "seed",
                                                  "frequency_penalty", "presence_penalty")
                    if getattr(cfg, k, None) is not None and k != "seed"}
        return lowered_program.run(system, turns, fields, cfg.max_tokens or FIELD_MAX_TOKENS,
                                   backend=self.backend, stream=stream, **sampling)

    def _run_lowered(self, request, system, turns, fields) -> Response:
        return self._response(self._start(request, system, turns, fields, stream=False))

    def _response(self, state) -> Response:
        error = state.error()
        if error is not None:
            raise _lm15_error(error)
        content = state.messages()[-1]["content"]
        metas = [m for m in state._ex.meta_info.values() if isinstance(m, dict)]
        first = next((m for m in metas if "prompt_tokens" in m), {})
        out_tokens = sum(m.get("completion_tokens", 0) for m in metas)
        finish = "length" if any((m.get("finish_reason") or {}).get("type") == "length"
                                 for m in metas) else "stop"
        usage = Usage(input_tokens=first.get("prompt_tokens", 0), output_tokens=out_tokens,
                      cache_read_tokens=first.get("cached_tokens", 0))
        return Response(id=f"sgl-{uuid.uuid4().hex}", model=self.model,
                        message=Message.assistant([TextPart(content)]), finish_reason=finish,
                        usage=usage)

    # -- OpenAI route --------------------------------------------------------------------------
    def _chat(self, request) -> Response:
        kw = openai_kwargs(request, self.model)
        turns = [{"role": m.role, "content": m.text or ""} for m in request.messages]
        system = _text_of(request.system)
        messages = ([{"role": "system", "content": system}] if system else []) + turns
        template = self.backend.chat_template
        if len(messages) > 1 and all(m["role"] in template.roles for m in messages):
            self.hints.ensure(template.render([(m["role"], m["content"])
                                               for m in messages[:-1]]))
        try:
            resp = self.client.chat.completions.create(messages=messages, **kw)
        except self._openai.APIStatusError as exc:
            raise (InvalidRequestError if exc.status_code < 500 else ServerError)(exc.message) from exc
        except self._openai.APIError as exc:
            raise TransportError(str(exc)) from exc
        return chat_response(resp, self.model)


def chat_response(resp: Any, model: str) -> Response:
    """An OpenAI chat completion as a dspy.lm15 Response (text, tool calls, usage with cached
    tokens, logprobs)."""
    choice = resp.choices[0]
    parts: list[Any] = [TextPart(choice.message.content)] if choice.message.content else []
    for call in choice.message.tool_calls or []:
        parts.append(ToolCallPart(id=call.id, name=call.function.name,
                                  input=json.loads(call.function.arguments or "{}")))
    if not parts:
        parts = [TextPart("")]
    u = resp.usage
    cached = getattr(getattr(u, "prompt_tokens_details", None), "cached_tokens", None)
    usage = Usage(input_tokens=u.prompt_tokens if u else 0,
                  output_tokens=u.completion_tokens if u else 0, cache_read_tokens=cached)
    return Response(id=resp.id, model=model, message=Message.assistant(parts),
                    finish_reason=_FINISH.get(choice.finish_reason, "stop"), usage=usage,
                    logprobs=_logprobs(choice.logprobs))


def _logprobs(logprobs: Any) -> tuple | None:
    """OpenAI choice logprobs as lm15 TokenLogprobs (None when not requested)."""
    if logprobs is None or not logprobs.content:
        return None
    return tuple(TokenLogprob(token=t.token, logprob=float(t.logprob), top=tuple(
        TopLogprob(token=a.token, logprob=float(a.logprob)) for a in t.top_logprobs or ()))
        for t in logprobs.content)


def openai_kwargs(request, model: str) -> dict[str, Any]:
    """The OpenAI chat-completion keywords of a dspy.lm15 Request (sampling, stop, logprobs,
    response_format, tools); ``max_tokens`` is always set (DEFAULT_MAX_TOKENS when the request
    has none)."""
    cfg = request.config
    kw: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens or DEFAULT_MAX_TOKENS}
    for name in ("temperature", "top_p", "seed", "frequency_penalty",
                 "presence_penalty"):
        if getattr(cfg, name) is not None:
            kw[name] = getattr(cfg, name)
    if cfg.stop:
        kw["stop"] = list(cfg.stop)
    if cfg.top_k is not None:
        kw["extra_body"] = {"top_k": cfg.top_k}
    if cfg.logprobs is not None:
        kw.update(logprobs=True, top_logprobs=cfg.logprobs)
    fmt = cfg.response_format
    if fmt is not None:
        if fmt["type"] == "json_schema":
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "response"), "schema": fmt["schema"],
                "strict": fmt.get("strict", True)}}
        else:
            kw["response_format"] = {"type": "json_object"}
    if request.tools:
        kw["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": getattr(t, "description", None) or "",
            "parameters": getattr(t, "parameters", None) or {"type": "object"}}}
            for t in request.tools]
        choice = cfg.tool_choice
        if choice is not None:
            if choice.allowed and choice.mode in ("required", "any") and len(choice.allowed) == 1:
                kw["tool_choice"] = {"type": "function", "function": {"name": choice.allowed[0]}}
            else:
                kw["tool_choice"] = "required" if choice.mode in ("required", "any") else choice.mode
    return kw


def _lm15_error(error: BaseException) -> Exception:
    status = getattr(error, "status", None)
    if status is not None and status < 500:
        return InvalidRequestError(str(error))
    if status is not None:
        return ServerError(str(error))
    return TransportError(str(error))


class AsyncSGLangEngine:
    """The async twin: the sync engine's calls off the event loop (``asyncio.to_thread``).
    Subclasses name their sync engine in ``sync_class`` (used by ``load_state``)."""

    sync_class: type = SGLangEngine

    def __init__(self, sync: Any):
        self.sync = sync

    def dump_state(self) -> dict[str, Any]:
        """The sync engine's state."""
        return self.sync.dump_state()

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> AsyncSGLangEngine:
        """An async engine around the sync engine :meth:`dump_state` described."""
        return cls(cls.sync_class.load_state(state))

    async def complete(self, request) -> Response:
        """The sync engine's complete() on a worker thread."""
        return await asyncio.to_thread(self.sync.complete, request)

    async def stream(self, request):
        """The sync engine's stream events, each taken on a worker thread."""
        it = self.sync.stream(request)
        done = object()
        while True:
            event = await asyncio.to_thread(next, it, done)
            if event is done:
                return
            yield event

    async def aclose(self) -> None:
        """The sync engine's close() on a worker thread."""
        await asyncio.to_thread(self.sync.close)
