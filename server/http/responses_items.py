"""The OpenAI Responses API's data model, mapped onto the chat path: a ``POST /v1/responses``
body becomes a :class:`ChatCompletionRequest` (so templates, tools, grammars, images and
reasoning go through :func:`server.http.admission.admit_chat` like any chat request), and a
finished generation becomes the Responses ``output`` items. Also the bounded store behind
``previous_response_id``.

Mapping (the field names are the Responses API's, https://platform.openai.com/docs/api-reference/responses):

* ``input``: a string (one user message) or items: messages (``{"role", "content"}`` with or
  without ``"type": "message"``; content parts ``input_text``, ``output_text``,
  ``input_image`` with a data URL), ``function_call`` and ``function_call_output`` (shown to
  the model as chat tool calls and tool messages); ``reasoning`` items are dropped, as chat
  templates drop earlier thinking. ``instructions`` is a system message at the front; it is
  not carried over to a later response by ``previous_response_id`` (as OpenAI does).
* ``text.format``: ``text``, ``json_object`` or ``json_schema`` (grammar-enforced).
* ``tools``: function tools only; ``tool_choice``: none, auto, required or a named function.
* ``max_output_tokens``, ``temperature``, ``top_p``, ``top_logprobs`` with
  ``include=["message.output_text.logprobs"]``; the chat route's extensions ``seed``,
  ``top_k``, ``min_p``, ``repetition_penalty``, ``logit_bias``, ``ignore_eos``, ``min_tokens``.
* Accepted and ignored (no effect on this server): ``metadata`` (echoed), ``user``,
  ``safety_identifier``, ``prompt_cache_key`` (the radix cache is automatic),
  ``service_tier``, ``parallel_tool_calls``, ``max_tool_calls`` (a reply holds at most one
  call), ``reasoning`` (a reasoning model thinks as its template says), ``stream_options``.
* Refused with a 400 naming the field: ``background``, ``conversation``, ``prompt``
  (stored prompts), ``truncation="auto"``, built-in tools (web search, file search, ...),
  file and audio inputs, ``item_reference`` items, other ``include`` values.

Errors: :class:`server.http.tokenizer_manager.ApiError` (400, 404 for an unknown stored id).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any

from pydantic import Field, ValidationError

from server.http.errors import ApiError
from server.http.schemas import MAX_MESSAGES, ChatCompletionRequest, RequestBody

LOGPROBS_INCLUDE = "message.output_text.logprobs"
IGNORED_INCLUDES = {"reasoning.encrypted_content"}  # no encrypted reasoning: nothing to add


class ResponsesRequest(RequestBody):
    """``POST /v1/responses`` body (unknown fields are ignored, as the OpenAI API does)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    user: str | None = None
    # extensions, as on the chat route (SGLang / vLLM names)
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)


EXTENSIONS = ("seed", "top_k", "min_p", "repetition_penalty", "logit_bias", "ignore_eos",
              "min_tokens")


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style id, e.g. ``resp_<32 hex digits>`` for ``prefix="resp"``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- request -> chat
def check_supported(body: ResponsesRequest) -> None:
    """Raise ApiError 400 naming the first field this server does not implement."""
    if body.background:
        raise ApiError(400, "background responses are not supported", param="background")
    if body.conversation is not None:
        raise ApiError(400, "'conversation' is not supported; chain responses with "
                       "previous_response_id", param="conversation")
    if body.prompt is not None:
        raise ApiError(400, "stored prompts ('prompt') are not supported", param="prompt")
    if body.truncation not in (None, "disabled"):
        raise ApiError(400, "only truncation='disabled' is supported", param="truncation")
    for inc in body.include or ():
        if inc != LOGPROBS_INCLUDE and inc not in IGNORED_INCLUDES:
            raise ApiError(400, f"include value {inc!r} is not supported (supported: "
                           f"{LOGPROBS_INCLUDE!r})", param="include")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ``{"type": "function", "name", "parameters", ...}`` as chat
    tools ``{"type": "function", "function": {...}}``. Raises ApiError for other tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ApiError(400, f"tools[{i}]: tool type {kind!r} is not supported (only "
                           "'function' tools)", param=f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses ``tool_choice`` (a mode or ``{"type": "function", "name"}``) in chat form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        raise ApiError(400, "tool_choice 'allowed_tools' is not supported", param="tool_choice")
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``. Raises ApiError when malformed."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                              "json_schema"):
        raise ApiError(400, "text.format.type must be text, json_object or json_schema",
                       param="text.format")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, "text.format.schema must be a JSON schema object",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt["schema"]}}
    return {"type": fmt["type"]}


def _content_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's Responses content as chat content (text, or text and image_url parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content parts",
                       param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise ApiError(400, f"{where}[{j}].text must be a string",
                               param=f"{where}[{j}].text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        elif kind == "input_image":
            raise ApiError(400, f"{where}[{j}]: give the image as image_url (a data: URL); "
                           "file ids are not supported", param=f"{where}[{j}]")
        else:
            raise ApiError(400, f"{where}[{j}]: content part type {kind!r} is not supported",
                           param=f"{where}[{j}].type")
    return parts


def chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``input`` of a request as chat messages. Raises ApiError naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"{where}.role must be user, system, developer or "
                               "assistant", param=f"{where}.role")
            out.append({"role": role, "content": _content_parts(item.get("content"),
                                                                f"{where}.content")})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}: a function_call needs string 'name' and "
                               "'call_id'", param=where)
            out.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _content_parts(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"{where}: input item type {kind!r} is not supported",
                           param=f"{where}.type")
    return out


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]
                 ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(the chat request to admit, the conversation without instructions: ``history`` (from
    previous_response_id) followed by this input). Raises ApiError."""
    check_supported(body)
    conversation = history + chat_messages(body.input)
    messages = ([{"role": "system", "content": body.instructions}]
                if body.instructions else []) + conversation
    want_lp = LOGPROBS_INCLUDE in (body.include or ())
    try:
        chat = ChatCompletionRequest(
            messages=messages, max_tokens=body.max_output_tokens, temperature=body.temperature,
            top_p=body.top_p, tools=chat_tools(body.tools),
            tool_choice=chat_tool_choice(body.tool_choice),
            response_format=chat_response_format(body.text), logprobs=want_lp,
            top_logprobs=body.top_logprobs if want_lp else None, stream=body.stream,
            **{name: getattr(body, name) for name in EXTENSIONS})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"input: {loc}: {first['msg']}", param="input") from exc
    return chat, conversation


# ---------------------------------------------------------------- output items
def message_item(item_id: str, text: str, status: str,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant ``message`` output item holding one ``output_text`` part; ``status``:
    in_progress, completed or incomplete; ``logprobs``: chat-style token entries."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [part]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    """A ``reasoning`` output item carrying the model's thinking as ``reasoning_text``."""
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def function_call_item(item_id: str, call: dict[str, Any], status: str = "completed"
                       ) -> dict[str, Any]:
    """A chat ``tool_calls`` entry as a Responses ``function_call`` item."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def as_chat_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages that continue the conversation."""
    return chat_messages([item for item in output if item["type"] != "reasoning"])


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int,
          reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses ``usage`` object (counts in tokens); every prompt token the radix cache
    did not hold is written to it, so ``cache_write_tokens`` is the uncached rest."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens,
                                     "cache_write_tokens": prompt_tokens - cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(rid: str, created: float, model: str, body: ResponsesRequest,
                    status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None = None,
                    incomplete_reason: str | None = None) -> dict[str, Any]:
    """The ``response`` object, echoing the request's settings as OpenAI does."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None, "incomplete_details": {"reason": incomplete_reason}
        if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "model": model, "output": output, "parallel_tool_calls": body.parallel_tool_calls
        if body.parallel_tool_calls is not None else True,
        "previous_response_id": body.previous_response_id, "reasoning": body.reasoning,
        "store": body.store, "temperature": body.temperature if body.temperature is not None
        else 1.0, "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "top_p": body.top_p if body.top_p is not None else 1.0,
        "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled",
        "usage": usage, "user": body.user, "metadata": body.metadata or {}}


# ---------------------------------------------------------------- the store
class ResponseStore:
    """Finished responses (``store=true``) by id, for ``previous_response_id`` and
    ``GET /v1/responses/{id}``: at most ``capacity`` entries and about ``max_bytes`` of them
    (an entry is charged its response's and conversation's JSON size, shared history included,
    so a client cannot fill the memory with large inputs), least recently used evicted first.
    Each entry keeps the response object and its conversation as chat messages (the input
    history without instructions, then the output)."""

    def __init__(self, capacity: int, max_bytes: int = 256 << 20):
        self.capacity, self.max_bytes = capacity, max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = \
            OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` and the conversation that led to it (for previous_response_id),
        evicting the least recently used past ``capacity`` entries or ``max_bytes``; one
        larger than ``max_bytes`` alone is not kept."""
        cost = len(json.dumps(response)) + len(json.dumps(conversation))
        if self.capacity <= 0 or cost > self.max_bytes:
            return
        if response["id"] in self._entries:
            self._drop(response["id"])
        self._entries[response["id"]] = (response, conversation, cost)
        self.nbytes += cost
        while len(self._entries) > self.capacity or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, rid: str) -> None:
        self.nbytes -= self._entries.pop(rid)[2]

    def get(self, rid: str, param: str | None = None) -> tuple[dict[str, Any],
                                                               list[dict[str, Any]]]:
        """(response, conversation). Raises ApiError 404 for an unknown or evicted id."""
        if rid not in self._entries:
            raise ApiError(404, f"response {rid!r} not found (it was not stored, or it was "
                           f"evicted: this server keeps the last {self.capacity}, within "
                           f"{self.max_bytes >> 20} MiB)", param=param, type="not_found_error")
        self._entries.move_to_end(rid)
        response, conversation, _ = self._entries[rid]
        return response, conversation

    def delete(self, rid: str) -> None:
        """Forget ``rid``. Raises ApiError 404 when it is not stored."""
        self.get(rid)
        self._drop(rid)

    def __len__(self) -> int:
        return len(self._entries)
