"""The language's expressions: small frozen types that a program appends to its state.

``s += "text"``, ``s += sgl.gen("x")`` and ``s += sgl.user("hi")`` each append one expression;
``"a" + sgl.gen("x")`` builds a :class:`Concat`. The interpreter executes them in order on a
stream; the tracer records them as graph nodes. Sampling keywords live in one dataclass,
:class:`SamplingArgs`, passed whole and merged with ``dataclasses.replace`` (SGLang paper §2,
Fig. 1 for the primitives; field names follow SGLang's frontend).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any

from sgl_adapters.lang.grounding import substring_grammar

CHOICES_METHODS = ("token_length_normalized", "greedy", "unconditional_likelihood_normalized")
ROLES = ("system", "user", "assistant")

# Regexes for ``gen(dtype=...)``; the value is converted after generation.
DTYPE_REGEX = {int: r"[-+]?[0-9]{1,18}", float: r"[-+]?[0-9]{1,18}(\.[0-9]{1,12})?"}
DTYPE_CHOICES = {bool: ("True", "False")}


@dataclass(frozen=True)
class SamplingArgs:
    """Every sampling keyword of ``gen`` and of ``run``/``run_batch``. ``None`` means "not set":
    :meth:`merged` fills unset fields from defaults, and unset fields are never sent, so the
    server's own defaults apply.

    Units: ``max_tokens`` in tokens; penalties in [-2, 2]; ``temperature`` 0 is greedy.
    """

    max_tokens: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: Any = None
    ebnf: str | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    lora: str | None = None  # a served LoRA adapter's name (not a sampling parameter)

    def merged(self, defaults: SamplingArgs) -> SamplingArgs:
        """Fields set here win; unset ones come from ``defaults``."""
        unset = {f.name: getattr(defaults, f.name) for f in fields(self)
                 if getattr(self, f.name) is None}
        return dataclasses.replace(self, **unset)

    def stops(self) -> tuple[str, ...]:
        """The stop strings as a tuple (``stop`` may be one string, a list, or None)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def native(self) -> dict[str, Any]:
        """``sampling_params`` of the native ``/generate`` API (only the fields that are set)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or f.name in ("return_logprob", "top_logprobs_num", "lora"):
                continue
            if f.name == "max_tokens":
                out["max_new_tokens"] = v
            elif f.name in ("stop", "stop_token_ids"):
                out[f.name] = list(self.stops()) if f.name == "stop" else list(v)
            elif f.name == "json_schema":
                out[f.name] = v if isinstance(v, str) else json.dumps(v)
            else:
                out[f.name] = v
        return out


class Expr:
    """Base of every expression; ``+`` concatenates (strings become :class:`Text`)."""

    def __add__(self, other: Any) -> Concat:
        return Concat((self, to_expr(other)))

    def __radd__(self, other: Any) -> Concat:
        return Concat((to_expr(other), self))


@dataclass(frozen=True)
class Text(Expr):
    """Constant text appended to the state."""

    value: str


@dataclass(frozen=True)
class Concat(Expr):
    """Expressions appended in order (``a + b``)."""

    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate into variable ``name``. ``dtype`` int/float/bool/str constrains and converts."""

    name: str | None
    sampling: SamplingArgs = field(default_factory=SamplingArgs)
    dtype: type | None = None


@dataclass(frozen=True)
class Select(Expr):
    """Pick one of ``choices`` by scoring each continuation with prompt logprobs."""

    name: str | None
    choices: tuple[str, ...]
    method: str = "token_length_normalized"
    temperature: float = 0.0
    dtype: type | None = None  # bool: s[name] is True/False


def convert(value: str, dtype: type | None) -> Any:
    """The value of a ``gen``/``select`` variable as its dtype. Raises ValueError if it does not
    parse (only possible when the server ignored the constraint)."""
    if dtype is None or dtype is str:
        return value
    if dtype is bool:
        return value.strip() == "True"
    return dtype(value.strip())


@dataclass(frozen=True)
class RoleBegin(Expr):
    """Open a ``role`` turn (its chat-template prefix)."""

    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    """Close a ``role`` turn (its chat-template suffix)."""

    role: str


@dataclass(frozen=True)
class Image(Expr):
    """An image for multimodal models: a path, URL or data string, or raw bytes."""

    data: str | bytes


def to_expr(value: Any) -> Expr:
    """Strings become :class:`Text`; expressions pass through. Raises TypeError otherwise."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use a str or an "
                    "sgl expression (gen, select, user, ...)")


def flatten(expr: Expr) -> list[Expr]:
    """The leaves of an expression, in order (Concat removed)."""
    if isinstance(expr, Concat):
        return [leaf for part in expr.parts for leaf in flatten(part)]
    return [expr]


def gen(name: str | None = None, max_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None,
        regex: str | None = None, json_schema: Any = None, choices: list[str] | None = None,
        dtype: type | None = None, return_logprob: bool | None = None,
        top_logprobs_num: int | None = None, ebnf: str | None = None,
        substring_of: str | list[str] | None = None, max_words: int | None = None,
        lora: str | None = None) -> Expr:
    """Generate text into variable ``name`` (read it with ``s[name]``).

    ``regex``/``json_schema``/``ebnf`` constrain the output on the server (at most one);
    ``substring_of`` (a text or a list of texts) makes the output a contiguous word span of
    one of them (grounded extraction: :func:`sgl_adapters.lang.grounding.substring_grammar`),
    of at most ``max_words`` words when given;
    ``dtype`` in int/float/bool/str constrains it and converts ``s[name]``; ``choices`` makes
    this a :func:`select`. ``lora``: the LoRA adapter (served by name) that generates it: the
    bundled server's ``lora_path``, an OpenAI endpoint's ``model``.
    Raises ValueError for conflicting constraints or an unknown dtype.
    """
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0)
    if substring_of is not None:
        if ebnf is not None:
            raise ValueError("gen: give ebnf or substring_of, not both")
        ebnf = substring_grammar(substring_of, max_words)
    if sum(x is not None for x in (regex, json_schema, ebnf,
                                   dtype if dtype is not str else None)) > 1:
        raise ValueError("gen: give at most one of regex, json_schema, ebnf/substring_of and "
                         "dtype")
    if dtype is not None and dtype not in (int, float, bool, str):
        raise ValueError(f"gen: dtype must be int, float, bool or str, not {dtype!r}")
    sampling = SamplingArgs(
        max_tokens=max_tokens, stop=tuple(stop) if isinstance(stop, list) else stop,
        stop_token_ids=tuple(stop_token_ids) if stop_token_ids is not None else None,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        ignore_eos=ignore_eos, regex=regex if dtype is None else DTYPE_REGEX.get(dtype),
        json_schema=json_schema, ebnf=ebnf, return_logprob=return_logprob,
        top_logprobs_num=top_logprobs_num, lora=lora)
    if dtype is bool:
        return Select(name, DTYPE_CHOICES[bool], "token_length_normalized", 0.0, bool)
    return Gen(name, sampling, dtype)


def select(name: str | None = None, choices: list[str] | tuple[str, ...] = (),
           choices_method: str = "token_length_normalized", temperature: float = 0.0) -> Select:
    """Choose one of ``choices`` into variable ``name``; ``s.get_meta_info(name)`` holds the
    scores. Raises ValueError for empty/duplicate choices or an unknown method."""
    choices = tuple(choices)
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("select: choices must be a non-empty list of strings")
    if len(set(choices)) != len(choices):
        raise ValueError("select: choices must be distinct")
    if choices_method not in CHOICES_METHODS:
        raise ValueError(f"select: choices_method must be one of {CHOICES_METHODS}")
    return Select(name, choices, choices_method, temperature)


def _role(role: str, content: Any = None) -> Expr:
    if content is None:
        return Concat((RoleBegin(role), RoleEnd(role)))
    return Concat((RoleBegin(role), to_expr(content), RoleEnd(role)))


def system(content: Any = None) -> Expr:
    """A system turn around ``content`` (text or expressions), in the model's chat template."""
    return _role("system", content)


def user(content: Any = None) -> Expr:
    """A user turn around ``content``."""
    return _role("user", content)


def assistant(content: Any = None) -> Expr:
    """An assistant turn around ``content`` (typically a :func:`gen`)."""
    return _role("assistant", content)


def image(data: str | bytes) -> Image:
    """An image (path, URL, base64 data URL or bytes), sent to the server as ``image_data``."""
    return Image(data)
