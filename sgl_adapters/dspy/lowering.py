"""Lowering a DSPy ChatAdapter call into a program of the language.

Decision: lowering happens *inside the engine, from the adapter's request*. DSPy (3.4) picks
its adapter from ``dspy.settings.adapter`` and otherwise uses ``ChatAdapter``; an LM cannot
choose the adapter, and a user should change nothing but ``dspy.configure(lm=SGLangLM(...))``.
So the engine recognises ChatAdapter's request — the system message's field skeleton
(``[[ ## name ## ]]`` with a ``# note: the value you produce ...`` type note per output field)
and the last user message's "Respond with the corresponding output fields, starting with ..."
sentence — and recovers each output field's name, order and type from them:

* ``Literal[...]``, ``bool`` and ``Enum`` fields -> ``select`` over the allowed values;
* ``int`` / ``float`` -> a regex-constrained ``gen``;
* pydantic models, dicts, lists ("must adhere to the JSON schema: ...") -> a JSON-schema ``gen``;
* ``str`` (and anything else) -> ``gen`` up to the next ``[[ ##`` marker;
* a ``str`` field whose description ends with :func:`copied_from`'s marker, "(copied verbatim
  from `context`)" -> ``gen(substring_of=...)`` over that input field's value (each item of a
  list input on its own), so the answer is always a span of the retrieved passages.

The prompt (system, demos, inputs) is sent exactly as DSPy formatted it, rendered with the
model's chat template; the assistant turn is built from constants (the markers, never decoded)
and those primitives in the signature's order, so ChainOfThought's ``reasoning`` comes first in
the same stream. The result is ordinary ChatAdapter text that always parses: DSPy's
JSONAdapter fallback (a second call sharing no prefix, stanfordnlp/dspy#1932) never runs.

Limits: requests that are not ChatAdapter-shaped (JSONAdapter, XMLAdapter, custom adapters,
tool calls, explicit response formats, non-text content) are not lowered and go to the server's
OpenAI route unchanged (JSONAdapter's ``response_format`` is then enforced by the server's
grammar). The recognised text is ChatAdapter's in dspy 3.4.x; the tests pin it.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

import sgl_adapters as sgl
from sgl_adapters.lang import ir

_RESPOND = re.compile(r"Respond with the corresponding output fields, starting with the field (.*?),?"
                      r"\s*and then ending with the marker for `\[\[ ## completed ## \]\]`", re.S)
_FIELD = re.compile(r"`\[\[ ## (\w+) ## \]\]`(?: \(must be formatted as a valid Python (.*?)\))?"
                    r"(?=, then |, and then|,?\s*$)", re.S)
_NOTE = "        # note: the value you produce "
STR_STOP = "[[ ##"
_COPIED = re.compile(r"^\d+\. `(\w+)` \([^\n]*\(copied verbatim from `(\w+)`"
                     r"(?:, at most (\d+) words)?\)\s*$", re.M)


def copied_from(field: str, desc: str = "", max_words: int | None = None) -> str:
    """An output field description that makes the lowered program copy the answer verbatim
    from input field ``field``: ``answer: str = dspy.OutputField(desc=copied_from("context",
    "a short phrase", max_words=8))``. The answer is then grammar-constrained to a contiguous
    word span (of at most ``max_words`` words) of the input's text (of one item when the
    input is a list)."""
    limit = f", at most {max_words} words" if max_words else ""
    return f"{desc} (copied verbatim from `{field}`{limit})".strip()


def _input_texts(last_user: str, name: str) -> list[str] | None:
    """The value of input field ``name`` in ChatAdapter's user message: a JSON list's items,
    or the text."""
    m = re.search(rf"\[\[ ## {name} ## \]\]\n(.*?)(?=\n\n\[\[ ## |\n\nRespond with|\Z)",
                  last_user, re.S)
    if m is None:
        return None
    value = m.group(1)
    try:
        items = json.loads(value)
    except ValueError:
        return [value]
    if isinstance(items, list) and items and all(isinstance(i, str) for i in items):
        return items
    return [value]


@dataclass(frozen=True)
class OutputField:
    """One output field: ``kind`` in str, select, int, float, json."""

    name: str
    kind: str = "str"
    choices: tuple[str, ...] = ()
    schema: Any = None
    texts: tuple[str, ...] = ()  # kind "span": the answer is a word span of one of these
    max_words: int | None = None

    def expr(self, max_tokens: int) -> ir.Expr:
        """The primitive that produces this field (``max_tokens`` bounds free text and
        JSON): select, a regex gen for int/float, a JSON-schema gen, a span gen, or a gen up
        to the next field marker."""
        if self.kind == "select":
            return sgl.select(self.name, self.choices)
        if self.kind in ("int", "float"):
            return sgl.gen(self.name, dtype=int if self.kind == "int" else float, max_tokens=32)
        if self.kind == "json":
            return sgl.gen(self.name, json_schema=self.schema, max_tokens=max_tokens)
        if self.kind == "span":
            return sgl.gen(self.name, substring_of=list(self.texts), max_words=self.max_words,
                           max_tokens=max_tokens)
        return sgl.gen(self.name, stop=STR_STOP, max_tokens=max_tokens)


def plan_fields(system: str, last_user: str) -> list[OutputField] | None:
    """The output fields of a ChatAdapter request, or None when it is not one."""
    m = _RESPOND.search(last_user)
    if m is None or "[[ ## completed ## ]]" not in system:
        return None
    copied = {out: (src, int(limit) if limit else None)
              for out, src, limit in _COPIED.findall(system)}
    fields = []
    for fm in _FIELD.finditer(m.group(1)):
        name, annotation = fm.group(1), fm.group(2)
        if f"[[ ## {name} ## ]]\n{{{name}}}" not in system:
            return None
        field = _field(name, annotation, _note(system, name))
        texts = _input_texts(last_user, copied[name][0]) if name in copied else None
        if field.kind == "str" and texts and any(re.search(r"\w", t) for t in texts):
            field = OutputField(name, "span", texts=tuple(t for t in texts
                                                          if re.search(r"\w", t)),
                                max_words=copied[name][1])
        fields.append(field)
    return fields or None


def _note(system: str, name: str) -> str | None:
    start = system.index(f"[[ ## {name} ## ]]\n{{{name}}}") + len(f"[[ ## {name} ## ]]\n{{{name}}}")
    line = system[start:].split("\n", 1)[0]
    return line[len(_NOTE):] if line.startswith(_NOTE) else None


def _field(name: str, annotation: str | None, note: str | None) -> OutputField:
    if note is None:
        return OutputField(name)
    if note == "must be True or False":
        return OutputField(name, "select", ("True", "False"))
    if note in ("must be a single int value", "must be a single float value"):
        return OutputField(name, note.split()[-2])
    if note.startswith("must exactly match (no extra characters) one of: "):
        choices = _literal_values(annotation) or tuple(note.split(": ", 1)[1].split("; "))
        return OutputField(name, "select", choices)
    if note.startswith("must be one of: "):
        return OutputField(name, "select", tuple(note[len("must be one of: "):].split("; ")))
    if note.startswith("must adhere to the JSON schema: "):
        try:
            return OutputField(name, "json", schema=json.loads(note.split(": ", 1)[1]))
        except ValueError:
            return OutputField(name)
    return OutputField(name)


def _literal_values(annotation: str | None) -> tuple[str, ...] | None:
    if not annotation or not annotation.startswith("Literal[") or not annotation.endswith("]"):
        return None
    try:
        values = ast.literal_eval("[" + annotation[len("Literal["):-1] + "]")
    except (ValueError, SyntaxError):
        return None
    choices = tuple(str(v) for v in values)
    return choices if choices and len(set(choices)) == len(choices) else None


def _lowered(s, system: str | None, turns: list[tuple[str, str]], fields: list[OutputField],
             max_tokens: int) -> None:
    if system:
        s += sgl.system(system)
    for role, text in turns:
        s += ir.Concat((ir.RoleBegin(role), ir.Text(text), ir.RoleEnd(role)))
    with s.assistant():
        for f in fields:
            s += f"[[ ## {f.name} ## ]]\n" + f.expr(max_tokens) + "\n\n"
        s += "[[ ## completed ## ]]"


lowered_program = sgl.function(_lowered)
