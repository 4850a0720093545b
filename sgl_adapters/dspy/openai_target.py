"""DSPy against any OpenAI-compatible chat endpoint (OpenAI, vLLM, llama.cpp, our own /v1):
``SGLangLM(model, base_url=".../v1", backend="openai")``.

A ChatAdapter call whose output fields :func:`~sgl_adapters.dspy.lowering.plan_fields`
recognises is answered with **one** chat call that produces every output field, then matched
field by field (API speculative execution, SGLang paper §5: one call's continuation is
speculated to hold the later fields, and each field is checked against what the program
expects before it is accepted):

* ``structured_outputs=True`` (default; OpenAI, vLLM, llama.cpp and our server support it):
  the call carries ``response_format`` json_schema with one property per output field in the
  signature's order (ChainOfThought's reasoning first): ``Literal``/``bool``/Enum as ``enum``,
  ``int``/``float`` as decimal strings with a pattern, pydantic/dict/list as their schema,
  ``str`` as a string.
* ``structured_outputs=False``: the call asks for ChatAdapter's own ``[[ ## field ## ]]``
  format (DSPy's prompt already does) and the markers are matched in order.

Either way every field is validated on the client (the choices, the number, the JSON schema with
``jsonschema``, a :func:`copied_from` span against its passage), since an endpoint may accept
``response_format`` and ignore it. **Retry rule:** if a field fails, the call is made once more
with the same messages plus a user message naming the failure (and twice the ``max_tokens``
when the first answer was cut by it); if that fails too, DSPy gets the text as it came (its own
parser reports it). With structured outputs, free-text fields are bounded by ``maxLength`` from
``max_tokens`` so the JSON object closes within the budget. The answer goes back
to DSPy as ChatAdapter text, so DSPy parses it as usual.

Token account: each :class:`~dspy.lm15.Response` carries the input, output and cached tokens
of all calls it took (as the endpoint reports them; without a ``usage`` from the endpoint,
counted with ``tiktoken`` for OpenAI model names when it is installed, else 0).
Other requests (JSONAdapter, tools, ``response_format`` set by DSPy) go to the endpoint as
they are.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Iterator

from dspy.lm15 import (
    InvalidRequestError,
    Message,
    Response,
    ServerError,
    TextPart,
    TransportError,
    Usage,
    response_to_events,
)

from sgl_adapters.dspy.engine import (
    AsyncSGLangEngine,
    _text_of,
    _turns,
    chat_response,
    openai_kwargs,
)
from sgl_adapters.dspy.lowering import OutputField, plan_fields


class FieldMismatch(ValueError):
    """An output field the endpoint's answer did not produce as the signature requires."""


def field_schema(f: OutputField) -> dict[str, Any]:
    """The JSON schema of one output field's value."""
    if f.kind == "select":
        return {"type": "string", "enum": list(f.choices)}
    # numbers as bounded decimal strings: a JSON number's digits are unbounded, and a small
    # model under a number grammar can write digits until max_tokens
    if f.kind == "int":
        return {"type": "string", "pattern": r"^-?\d{1,12}$"}
    if f.kind == "float":
        return {"type": "string", "pattern": r"^-?\d{1,12}(\.\d{1,6})?$"}
    if f.kind == "json":
        return f.schema if isinstance(f.schema, dict) else {}
    return {"type": "string"}


def output_schema(fields: list[OutputField], max_tokens: int | None = None) -> dict[str, Any]:
    """One object with every output field, in order, all required. With ``max_tokens``, free
    text fields share a ``maxLength`` (characters: one per token of the budget left after ~16
    tokens per field of JSON overhead), so the object closes before the budget ends."""
    props = {f.name: field_schema(f) for f in fields}
    free = [f.name for f in fields if f.kind in ("str", "span")]
    if max_tokens and free:
        chars = max(16, (max_tokens - 16 * len(fields)) // len(free))
        for name in free:
            props[name] = {**props[name], "maxLength": chars}
    return {"type": "object", "properties": props, "required": [f.name for f in fields],
            "additionalProperties": False}


def check_field(f: OutputField, value: Any) -> str:
    """``value`` as ChatAdapter text for field ``f``. Raises FieldMismatch."""
    if f.kind == "select":
        text = str(value).strip()
        if text not in f.choices:
            raise FieldMismatch(f"{f.name}: {text!r} is not one of {list(f.choices)}")
        return text
    if f.kind in ("int", "float"):
        try:
            number = int(value) if f.kind == "int" else float(value)
        except (TypeError, ValueError) as exc:
            raise FieldMismatch(f"{f.name}: {value!r} is not a number of type {f.kind}") \
                from exc
        if f.kind == "int" and isinstance(value, float) and value != int(value):
            raise FieldMismatch(f"{f.name}: {value!r} is not an int")
        return str(number)
    if f.kind == "json":
        import jsonschema

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise FieldMismatch(f"{f.name}: not JSON") from exc
        try:
            jsonschema.validate(value, f.schema or {})
        except jsonschema.ValidationError as exc:
            raise FieldMismatch(f"{f.name}: {exc.message}") from exc
        return json.dumps(value)
    text = str(value).strip()
    if f.kind == "span" and not any(text and text in t for t in f.texts):
        raise FieldMismatch(f"{f.name}: {text!r} is not copied from the passages")
    return text


def match_markers(text: str, fields: list[OutputField]) -> dict[str, Any]:
    """Field values from ChatAdapter-format text, matched marker by marker in order. Raises
    FieldMismatch naming the first field whose marker is missing."""
    values, pos = {}, 0
    for i, f in enumerate(fields):
        m = re.compile(rf"\[\[ ## {re.escape(f.name)} ## \]\]").search(text, pos)
        if m is None:
            raise FieldMismatch(f"{f.name}: its marker [[ ## {f.name} ## ]] is missing")
        nxt = re.compile(r"\[\[ ## \w+ ## \]\]").search(text, m.end())
        end = nxt.start() if nxt is not None else len(text)
        values[f.name] = text[m.end():end].strip()
        pos = end
    return values


def chat_adapter_text(fields: list[OutputField], values: dict[str, str]) -> str:
    """The answer as ChatAdapter writes it: each field after its marker, then the end marker."""
    return "".join(f"[[ ## {f.name} ## ]]\n{values[f.name]}\n\n" for f in fields) + \
        "[[ ## completed ## ]]"


class OpenAITargetEngine:
    """Sync engine (DSPy 3.4's custom-engine contract). Args: ``base_url`` of the OpenAI API
    (ending in ``/v1``), ``model``, ``api_key``, ``structured_outputs`` (the endpoint honours
    ``response_format`` json_schema), ``timeout`` (seconds per request)."""

    supports_function_calling = True
    supports_response_schema = True
    supports_reasoning = False
    supported_params = frozenset({"response_format", "tools", "tool_choice", "logprobs",
                                  "top_logprobs", "seed", "stop"})

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None,
                 structured_outputs: bool = True, timeout: float = 600.0):
        import openai

        self.base_url, self.model = base_url.rstrip("/"), model
        self.structured_outputs, self.timeout = structured_outputs, timeout
        self._openai = openai
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY",
                                    timeout=timeout, max_retries=0)

    def dump_state(self) -> dict[str, Any]:
        """What DSPy saves of this engine (never the API key)."""
        return {"base_url": self.base_url, "model": self.model,
                "structured_outputs": self.structured_outputs, "timeout": self.timeout}

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> OpenAITargetEngine:
        """The engine :meth:`dump_state` described."""
        return cls(**state)

    def close(self) -> None:
        """Close the HTTP client."""
        self.client.close()

    def complete(self, request) -> Response:
        """DSPy's engine contract: one request, one response. A ChatAdapter request becomes
        one call holding every output field, checked field by field; anything else goes to the
        chat route as it is."""
        fields = self._fields(request)
        if fields is None:
            return chat_response(self._create(openai_kwargs(request, self.model),
                                              self._messages(request)), self.model)
        return self._speculate(request, fields)

    def stream(self, request) -> Iterator:
        """The complete response as stream events (the fields are checked before any is
        sent)."""
        yield from response_to_events(self.complete(request))

    # -- the one-call program --------------------------------------------------------------------
    def _fields(self, request) -> list[OutputField] | None:
        if request.tools or request.config.response_format is not None:
            return None
        system, turns = _text_of(request.system), _turns(request)
        if system is None or not turns or turns[-1][0] != "user":
            return None
        return plan_fields(system, turns[-1][1])

    def _messages(self, request) -> list[dict[str, str]]:
        system = _text_of(request.system)
        turns = [{"role": m.role, "content": m.text or ""} for m in request.messages]
        return ([{"role": "system", "content": system}] if system else []) + turns

    def _speculate(self, request, fields: list[OutputField]) -> Response:
        kw = openai_kwargs(request, self.model)
        if self.structured_outputs:
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "outputs", "schema": output_schema(fields, kw.get("max_tokens")),
                "strict": True}}
        messages = self._messages(request)
        account = [0, 0, 0]
        error, truncated = None, False
        for _ in range(2):
            if error is not None:  # the retry: the same call, told what was wrong
                if truncated and kw.get("max_tokens"):
                    kw = {**kw, "max_tokens": 2 * kw["max_tokens"]}
                messages = messages + [{"role": "user", "content": (
                    f"Your previous answer was not usable ({error}). Answer again with every "
                    "output field" + (" as the JSON object." if self.structured_outputs else
                                      ", each after its [[ ## field ## ]] marker."))}]
            resp = self._create(kw, messages)
            text = resp.choices[0].message.content or ""
            truncated = resp.choices[0].finish_reason == "length"
            self._count(resp, messages, text, account)
            try:
                values = self._values(text, fields)
                out = chat_adapter_text(fields, values)
                break
            except FieldMismatch as exc:
                error = str(exc)
        else:
            out = text  # DSPy's parser reports it (and may fall back)
        return Response(id=f"sgl-{uuid.uuid4().hex}", model=self.model,
                        message=Message.assistant([TextPart(out)]), finish_reason="stop",
                        usage=Usage(input_tokens=account[0], output_tokens=account[1],
                                    cache_read_tokens=account[2]))

    def _values(self, text: str, fields: list[OutputField]) -> dict[str, str]:
        if self.structured_outputs:
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise FieldMismatch("the answer is not a JSON object") from exc
            if not isinstance(obj, dict):
                raise FieldMismatch("the answer is not a JSON object")
            missing = [f.name for f in fields if f.name not in obj]
            if missing:
                raise FieldMismatch(f"{missing[0]}: missing")
        else:
            obj = match_markers(text, fields)
        return {f.name: check_field(f, obj[f.name]) for f in fields}

    def _create(self, kw: dict[str, Any], messages: list[dict[str, str]]) -> Any:
        try:
            return self.client.chat.completions.create(messages=messages, **kw)
        except self._openai.APIStatusError as exc:
            raise (InvalidRequestError if exc.status_code < 500 else ServerError)(exc.message) \
                from exc
        except self._openai.APIError as exc:
            raise TransportError(str(exc)) from exc

    def _count(self, resp: Any, messages: list[dict[str, str]], text: str,
               account: list[int]) -> None:
        u = resp.usage
        if u is not None and u.prompt_tokens is not None:
            cached = getattr(getattr(u, "prompt_tokens_details", None), "cached_tokens", 0)
            account[0] += u.prompt_tokens
            account[1] += u.completion_tokens or 0
            account[2] += cached or 0
            return
        counted = _tiktoken_count(self.model, "".join(m["content"] for m in messages), text)
        if counted is not None:
            account[0] += counted[0]
            account[1] += counted[1]


def _tiktoken_count(model: str, prompt: str, completion: str) -> tuple[int, int] | None:
    """(prompt, completion) tokens by tiktoken for an OpenAI model name; None when tiktoken is
    not installed or does not know the model."""
    try:
        import tiktoken

        enc = tiktoken.encoding_for_model(model)
    except (ImportError, KeyError):
        return None
    return len(enc.encode(prompt)), len(enc.encode(completion))


class AsyncOpenAITargetEngine(AsyncSGLangEngine):
    """The async twin of :class:`OpenAITargetEngine` (the sync calls off the event loop)."""

    sync_class = OpenAITargetEngine
