"""Conversions between LangChain messages and the OpenAI chat wire format the server speaks."""

from __future__ import annotations

import json
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import tool_call_chunk


def _content(content: Any) -> Any:
    """Text content as a string; content blocks reduced to OpenAI parts (text, image_url)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
        elif block.get("type") == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif block.get("type") in ("image_url", "image"):
            parts.append(block)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def to_openai(message: BaseMessage) -> dict[str, Any]:
    """One LangChain message as an OpenAI chat message. Raises TypeError for unknown types."""
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": _content(message.content)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": _content(message.content)}
    if isinstance(message, AIMessage):
        out: dict[str, Any] = {"role": "assistant", "content": _content(message.content) or ""}
        if message.tool_calls:
            out["tool_calls"] = [{"id": tc["id"], "type": "function", "function": {
                "name": tc["name"], "arguments": json.dumps(tc["args"])}}
                for tc in message.tool_calls]
        return out
    if isinstance(message, ToolMessage):
        return {"role": "tool", "content": _content(message.content),
                "tool_call_id": message.tool_call_id}
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": _content(message.content)}
    raise TypeError(f"unsupported message type {type(message).__name__}")


def usage_metadata(usage: Any) -> dict[str, Any] | None:
    """LangChain usage metadata from an OpenAI usage object (cached tokens -> cache_read)."""
    if usage is None:
        return None
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) or 0
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "input_token_details": {"cache_read": cached}}


def from_openai(choice: Any, model: str, usage: Any) -> AIMessage:
    """The AIMessage of one OpenAI chat completion choice."""
    msg = choice.message
    tool_calls, invalid = [], []
    for tc in msg.tool_calls or []:
        try:
            tool_calls.append({"name": tc.function.name, "args": json.loads(tc.function.arguments
                                                                            or "{}"),
                               "id": tc.id, "type": "tool_call"})
        except ValueError as exc:
            invalid.append({"name": tc.function.name, "args": tc.function.arguments,
                            "id": tc.id, "error": str(exc), "type": "invalid_tool_call"})
    meta: dict[str, Any] = {"model_name": model, "finish_reason": choice.finish_reason,
                            "model_provider": "sglang"}
    if choice.logprobs is not None:
        meta["logprobs"] = choice.logprobs.model_dump()
    return AIMessage(content=msg.content or "", tool_calls=tool_calls, invalid_tool_calls=invalid,
                     usage_metadata=usage_metadata(usage), response_metadata=meta)


def chunk_from_openai(chunk: Any, model: str) -> AIMessageChunk | None:
    """An AIMessageChunk of one streamed OpenAI chunk (None when it carries nothing)."""
    usage = usage_metadata(chunk.usage)
    if not chunk.choices:
        if usage is None:
            return None
        return AIMessageChunk(content="", usage_metadata=usage, chunk_position="last")
    choice = chunk.choices[0]
    delta = choice.delta
    calls = [tool_call_chunk(name=tc.function.name if tc.function else None,
                             args=tc.function.arguments if tc.function else None,
                             id=tc.id, index=tc.index) for tc in delta.tool_calls or []]
    meta: dict[str, Any] = {}
    if choice.finish_reason is not None:
        meta = {"finish_reason": choice.finish_reason, "model_name": model,
                "model_provider": "sglang"}
    if choice.logprobs is not None:
        meta["logprobs"] = choice.logprobs.model_dump()
    return AIMessageChunk(content=delta.content or "", tool_call_chunks=calls,
                          usage_metadata=usage, response_metadata=meta)
