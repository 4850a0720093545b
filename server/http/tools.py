"""OpenAI tool calling on top of grammar-constrained decoding.

* ``tool_choice="required"`` (or ``"any"``) and a named function: the reply is constrained to a
  JSON object ``{"name": <tool>, "arguments": <that tool's parameters schema>}`` (an ``anyOf``
  over the allowed tools), so every call parses and its arguments validate.
* ``"auto"`` (the default when tools are given): the model writes freely; a reply that is a
  well-formed call of a known tool in that same JSON shape is returned as a tool call, anything
  else as text. ``"none"``: tools are ignored.
* The tools are shown to the model through its chat template when the template renders tools;
  otherwise as a system message listing them with the JSON shape to use.

Errors: :class:`ApiError` 400 naming ``tools`` or ``tool_choice``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from server.constrained.spec import GrammarError, make_spec
from server.http.errors import ApiError


def parse_tools(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{name: function spec} of the request's tools. Raises ApiError."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(fn, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': "
                           "{'name': ..., 'parameters': ...}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{i}].function.name must be a non-empty string",
                           param=f"tools[{i}].function.name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param="tools")
        if params.get("type", "object") != "object":  # arguments are a JSON object (OpenAI's rule)
            raise ApiError(400, f"tools[{i}].function.parameters must describe an object "
                           f"(type 'object'), not type {params['type']!r}: a call's arguments "
                           "are a JSON object", param=f"tools[{i}].function.parameters")
        try:  # checked for every tool_choice, not only when a call is forced
            make_spec(json_schema=params)
        except GrammarError as exc:
            raise ApiError(400, f"tools[{i}].function.parameters: {exc}",
                           param=f"tools[{i}].function.parameters") from exc
        if fn["name"] in out:
            raise ApiError(400, f"duplicate tool name {fn['name']!r}", param="tools")
        out[fn["name"]] = {**fn, "parameters": params}
    return out


def forced_names(tools: dict[str, dict], tool_choice: Any) -> list[str] | None:
    """Names the reply must call (grammar-enforced), [] for no tools, None for "auto".
    Raises ApiError 400 for a tool_choice that forces a call without tools to call."""
    if not tools and tool_choice not in (None, "auto", "none"):
        raise ApiError(400, "tool_choice forces a tool call but no tools are given",
                       param="tool_choice")
    if not tools or tool_choice == "none":
        return []
    if tool_choice in (None, "auto"):
        return None
    if tool_choice in ("required", "any"):
        return list(tools)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice.function.name must be a string",
                           param="tool_choice.function.name")
        if name not in tools:
            raise ApiError(400, f"tool_choice names unknown function {name!r}",
                           param="tool_choice")
        return [name]
    raise ApiError(400, "tool_choice must be none, auto, required or "
                   "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def call_schema(tools: dict[str, dict], names: list[str]) -> dict[str, Any]:
    """JSON schema of one call of any tool in ``names``."""
    options = [{"type": "object",
                "properties": {"name": {"const": n}, "arguments": tools[n]["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}
               for n in names]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tools_system_prompt(tools: dict[str, dict]) -> str:
    """The system prompt that lists ``tools`` (name -> OpenAI function) for a chat template
    that does not render tools itself."""
    listing = json.dumps([{"name": n, "description": t.get("description", ""),
                           "parameters": t["parameters"]} for n, t in tools.items()])
    return ("You can call these functions: " + listing + "\nTo call one, reply with only a JSON "
            'object {"name": <function name>, "arguments": <arguments object>}.')


def as_tool_call(text: str, tools: dict[str, dict]) -> dict[str, Any] | None:
    """The OpenAI tool_calls entry for ``text`` if it is a call of a known tool, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and obj.get("name") in tools
            and isinstance(obj.get("arguments"), dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(obj["arguments"])}}
