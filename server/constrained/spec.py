"""A request's constraint checked and normalized before anything compiles it: at most one of
regex / JSON schema / choices / EBNF, sized first (the checks run on the HTTP event loop, and
validating a schema costs time that grows with its size), JSON schemas validated with
``jsonschema`` (draft 2020-12) so errors are clear, nesting bounded, only local ``$ref``
entries and no recursion. The result is a hashable :class:`GrammarSpec`, the compile cache's key
(:mod:`server.constrained.grammar`).

Errors: :class:`GrammarError` (a ValueError with ``param``), answered as HTTP 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

MAX_SPEC_CHARS = 32 * 1024
MAX_SCHEMA_TEXT_CHARS = 4 * MAX_SPEC_CHARS  # a schema given as text, before its whitespace goes
MAX_EBNF_CHARS = 512 * 1024  # grounding grammars of long passages (~25 chars per word)
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 64  # dict/list levels


class GrammarError(ValueError):
    """A constraint that cannot be compiled (or took too long): a 400 naming ``param``, the
    request field it came from."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "regex", "json_schema", "choices" or "ebnf"; spec: the regex, the schema as
    canonical JSON text, the choices as a JSON list, or the EBNF grammar (xgrammar's dialect of
    GBNF: ``root ::= ...``)."""

    kind: str
    spec: str


def make_spec(regex: str | None = None, json_schema: Any = None,
              choices: Sequence[str] | None = None, ebnf: str | None = None
              ) -> GrammarSpec | None:
    """Validate and normalize the (at most one) constraint of a request. Raises GrammarError
    (an EBNF grammar's syntax is checked when it compiles, still before the response)."""
    given = [n for n, v in (("regex", regex), ("json_schema", json_schema),
                            ("choices", choices), ("ebnf", ebnf)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(given[1], f"only one constraint per request (got {', '.join(given)})")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise GrammarError("regex", "must be a non-empty string")
        _check_size("regex", regex)
        return GrammarSpec("regex", regex)
    if ebnf is not None:
        if not isinstance(ebnf, str) or "::=" not in ebnf:
            raise GrammarError("ebnf", "must be a grammar string with a 'root ::= ...' rule")
        if len(ebnf) > MAX_EBNF_CHARS:
            raise GrammarError("ebnf", f"over {MAX_EBNF_CHARS} characters")
        return GrammarSpec("ebnf", ebnf)
    if json_schema is not None:
        # sized before anything else: validating a schema costs time that grows with its size
        # (a 7 MB schema took 24 s), and this runs on the HTTP event loop
        text = None
        if isinstance(json_schema, str):
            if len(json_schema) > MAX_SCHEMA_TEXT_CHARS:  # room for indentation
                raise GrammarError("json_schema", f"over {MAX_SCHEMA_TEXT_CHARS} characters")
        else:
            try:  # keep key order: the schema's property order is the order fields are generated
                if len(msgspec.json.encode(json_schema)) > MAX_SPEC_CHARS:  # a lower bound of
                    raise GrammarError("json_schema", f"over {MAX_SPEC_CHARS} characters")
                text = json.dumps(json_schema, separators=(",", ":"))  # this, ~6x as fast
            except GrammarError:
                raise
            except (TypeError, ValueError) as exc:  # not JSON data; circular
                raise GrammarError("json_schema", f"not JSON data: {exc}") from exc
            _check_size("json_schema", text)
        schema = _load_schema(json_schema)
        if text is None:  # given as text: its compact form
            text = json.dumps(schema, separators=(",", ":"))
            _check_size("json_schema", text)
        return GrammarSpec("json_schema", text)
    if not isinstance(choices, (list, tuple)) or not choices:
        raise GrammarError("choices", "must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choices", f"at most {MAX_CHOICES} non-empty strings")
    if len(set(choices)) != len(choices):
        raise GrammarError("choices", "choices must be distinct")
    text = json.dumps(list(choices))
    _check_size("choices", text)
    return GrammarSpec("choices", text)


def _check_size(param: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(param, f"over {MAX_SPEC_CHARS} characters")


def _load_schema(value: Any) -> dict:
    import jsonschema

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise GrammarError("json_schema", f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise GrammarError("json_schema", "must be a JSON object")
    _check_depth_and_refs(value)
    try:
        jsonschema.Draft202012Validator.check_schema(value)
    except jsonschema.SchemaError as exc:
        raise GrammarError("json_schema", f"invalid JSON schema: {exc.message}") from exc
    if _is_recursive(value):
        raise GrammarError("json_schema", "recursive schemas ($ref cycles) are not supported")
    return value


def _check_depth_and_refs(schema: dict) -> None:
    """Refuse nesting deeper than MAX_SCHEMA_DEPTH (validators and compilers recurse) and any
    $ref that is not local ("#..."): nothing is fetched, and a dropped remote reference would
    silently change what the output must match. Iterative, so depth cannot overflow here."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError("json_schema", f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                raise GrammarError("json_schema", f"$ref {ref!r}: only local references "
                                   "('#/$defs/...') are supported")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _is_recursive(schema: dict) -> bool:
    """True when a local $ref can reach itself: "#" (the whole schema) anywhere, or a cycle
    among #/$defs/X and #/definitions/X."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}

    def refs(node: Any) -> set[str]:
        """Names referenced under ``node``; "#" stands for the root."""
        out: set[str] = set()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref == "#":
                out.add("#")
            elif isinstance(ref, str) and ref.startswith("#/"):
                out.add(ref.rsplit("/", 1)[-1])
            for v in node.values():
                out |= refs(v)
        elif isinstance(node, list):
            for v in node:
                out |= refs(v)
        return out

    if "#" in refs(schema):
        return True
    edges = {name: refs(body) for name, body in defs.items()}

    def reaches(start: str) -> bool:
        seen, stack = set(), list(edges.get(start, ()))
        while stack:
            n = stack.pop()
            if n == start:
                return True
            if n not in seen:
                seen.add(n)
                stack.extend(edges.get(n, ()))
        return False

    return any(reaches(name) for name in edges)
