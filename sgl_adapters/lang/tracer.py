"""Tracing a program into a dataflow graph without a model (SGLang paper §2/§4: the graph is
what lets the runtime see shared prefixes before running).

``fn.trace(**args)`` runs the function body once on a :class:`TracerState`. Arguments not given
become placeholders, and ``s[name]`` returns a placeholder for the generated value; using a
placeholder in text (``+``, f-strings, ``str``) records a dependency, while anything that needs
its *value* (``if``, ``==``, ``len``, iteration, ``int``, methods) raises :class:`NotTraceable`
— a program whose control flow depends on data is reported, never silently mis-traced.

The graph has one node list per stream (stream 0 is the program's state; ``fork`` adds streams)
and prints as text. :meth:`TracedProgram.constant_prefix` is the text every run of the program
starts with, which ``run_batch`` sends once as a cache hint.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from sgl_adapters.lang import ir
from sgl_adapters.lang.chat_template import ChatTemplate
from sgl_adapters.lang.scopes import RoleScopes, StateGroup


class NotTraceable(Exception):
    """The program's control flow or text depends on a value only known when it runs."""


_MARK = "\x1f{}\x1f"
_MARK_RE = re.compile("\x1f(\\d+)\x1f")


class Placeholder(str):
    """An unknown value (a program argument or a generated variable). It is a ``str`` whose
    text is a marker, so concatenation, f-strings and ``sgl.user(x)`` work and record where it
    is used; every operation that needs the actual value raises :class:`NotTraceable`."""

    def __new__(cls, pid: int, label: str) -> Placeholder:
        """Placeholder number ``pid`` standing for ``label`` (e.g. "argument 'question'")."""
        obj = super().__new__(cls, _MARK.format(pid))
        obj.__dict__.update(pid=pid, label=label)
        return obj

    def _value_needed(self, *_: Any, **__: Any) -> Any:
        raise NotTraceable(f"the program uses the value of {self.__dict__['label']} (control "
                           "flow or computation on data known only at run time)")

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _value_needed
    __len__ = __iter__ = __contains__ = __getitem__ = __int__ = __float__ = _value_needed
    __index__ = __hash__ = __call__ = __mul__ = __mod__ = _value_needed

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):  # str methods (strip, split, ...) need the value
            object.__getattribute__(self, "_value_needed")()
        return object.__getattribute__(self, name)


@dataclass
class Node:
    """One step of a stream. ``kind``: text, arg, var, gen, select, role_begin, role_end, image,
    fork, join. ``deps``: (stream, variable) pairs this node reads across streams."""

    kind: str
    label: str = ""
    detail: str = ""
    deps: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class TracedProgram:
    """The dataflow graph: ``streams[i]`` is the node list of stream i (0 = the program)."""

    streams: list[list[Node]]
    parents: dict[int, int]  # stream -> the stream it was forked from

    def constant_prefix(self, template: ChatTemplate) -> str:
        """Text every run of the program starts with (constants and role markers of stream 0
        before its first argument, variable or generation)."""
        out: list[str] = []
        for i, node in enumerate(self.streams[0]):
            if node.kind == "text":
                out.append(node.detail)
            elif node.kind == "role_begin":
                if i == 0 and node.label != "system":
                    out.append(template.default_system)
                out.append(template.prefix(node.label))
            elif node.kind == "role_end":
                out.append(template.suffix(node.label))
            else:
                break
        return "".join(out)

    def nodes(self, kind: str) -> list[Node]:
        """Every node of ``kind`` ("text", "gen", "select", "fork", ...) over all streams."""
        return [n for stream in self.streams for n in stream if n.kind == kind]

    def __str__(self) -> str:
        lines = []
        for sid, stream in enumerate(self.streams):
            origin = f" (forked from stream {self.parents[sid]})" if sid in self.parents else ""
            lines.append(f"stream {sid}{origin}:")
            for node in stream:
                text = f"  {node.kind:<10} {node.label}"
                if node.detail:
                    text += f" {node.detail!r}" if node.kind == "text" else f" {node.detail}"
                if node.deps:
                    text += "  <- " + ", ".join(f"stream {s}.{v}" for s, v in node.deps)
                lines.append(text.rstrip())
        return "\n".join(lines)


class _Tracer:
    def __init__(self) -> None:
        self.origin: dict[int, tuple[str, int, str]] = {}  # id -> (kind, stream, name)
        self.streams: list[list[Node]] = []
        self.parents: dict[int, int] = {}
        self.gathered: dict[tuple[int, str], list[int]] = {}  # (stream, var) -> fork streams
        self._ids = itertools.count()

    def arg(self, name: str) -> Placeholder:
        pid = next(self._ids)
        self.origin[pid] = ("arg", -1, name)
        return Placeholder(pid, f"argument {name!r}")

    def var(self, stream: int, name: str) -> Placeholder:
        pid = next(self._ids)
        self.origin[pid] = ("var", stream, name)
        return Placeholder(pid, f"variable {name!r}")

    def new_stream(self, parent: int | None) -> int:
        self.streams.append([])
        sid = len(self.streams) - 1
        if parent is not None:
            self.parents[sid] = parent
        return sid

    def record(self, sid: int, expr: ir.Expr) -> None:
        for leaf in ir.flatten(expr):
            if isinstance(leaf, ir.Text):
                self._record_text(sid, leaf.value)
            elif isinstance(leaf, ir.Gen):
                detail = " ".join(f"{k}={v!r}" for k, v in vars(leaf.sampling).items()
                                  if v is not None)
                if leaf.dtype is not None:
                    detail += f" dtype={leaf.dtype.__name__}"
                self.streams[sid].append(Node("gen", leaf.name or "", detail.strip()))
            elif isinstance(leaf, ir.Select):
                self.streams[sid].append(Node("select", leaf.name or "",
                                              f"choices={list(leaf.choices)}"))
            elif isinstance(leaf, ir.RoleBegin):
                self.streams[sid].append(Node("role_begin", leaf.role))
            elif isinstance(leaf, ir.RoleEnd):
                self.streams[sid].append(Node("role_end", leaf.role))
            elif isinstance(leaf, ir.Image):
                self.streams[sid].append(Node("image"))

    def _record_text(self, sid: int, text: str) -> None:
        text, pos = str.__str__(text), 0
        for m in _MARK_RE.finditer(text):
            if m.start() > pos:
                self.streams[sid].append(Node("text", detail=text[pos:m.start()]))
            kind, src, name = self.origin[int(m.group(1))]
            deps = [(src, name)] if kind == "var" and src != sid else []
            self.streams[sid].append(Node(kind, name, deps=deps))
            pos = m.end()
        if pos < len(text):
            self.streams[sid].append(Node("text", detail=text[pos:]))


class TracerState(RoleScopes):
    """Stands in for :class:`~sgl_adapters.lang.interpreter.ProgramState` while tracing."""

    def __init__(self, tracer: _Tracer, sid: int):
        self._tracer, self._sid = tracer, sid

    def _submit(self, expr: ir.Expr) -> None:
        self._tracer.record(self._sid, expr)

    def __iadd__(self, other: Any) -> TracerState:
        self._tracer.record(self._sid, ir.to_expr(other))
        return self

    def __getitem__(self, name: str) -> Placeholder | list[Placeholder]:
        forks = self._tracer.gathered.get((self._sid, name))
        if forks is not None:  # gathered by join: one value per fork
            return [self._tracer.var(f, name) for f in forks]
        return self._tracer.var(self._sid, name)

    get_var = __getitem__

    def get_meta_info(self, name: str) -> Any:
        """Not traceable: raises NotTraceable."""
        raise NotTraceable(f"the program reads the meta info of {name!r}")

    def text(self) -> str:
        """Not traceable: raises NotTraceable."""
        raise NotTraceable("the program reads the generated text")

    messages = text

    def sync(self) -> TracerState:
        """Nothing runs while tracing: the state itself."""
        return self

    def set_var(self, name: str, value: Any) -> None:
        """Not traceable: raises NotTraceable."""
        raise NotTraceable("the program sets variables from Python values")

    def fork(self, size: int) -> TracerGroup:
        """Record a fork into ``size`` new streams. Raises NotTraceable when ``size`` is not
        a constant int."""
        if not isinstance(size, int):
            raise NotTraceable("fork size depends on data")
        sids = [self._tracer.new_stream(self._sid) for _ in range(size)]
        self._tracer.streams[self._sid].append(
            Node("fork", str(size), f"-> streams {', '.join(map(str, sids))}"))
        return TracerGroup(self, [TracerState(self._tracer, s) for s in sids])


class TracerGroup(StateGroup):
    """The traced forks; ``join`` records the variables they gather."""

    def join(self, mode: str = "gather_variable") -> None:
        """Record the join; with "gather_variable" the parent's ``s[name]`` reads the forks'
        values."""
        tracer = self.parent._tracer
        deps = [(s._sid, n.label) for s in self.states
                for n in tracer.streams[s._sid] if n.kind in ("gen", "select") and n.label]
        if mode == "gather_variable":
            for _, name in deps:
                tracer.gathered[(self.parent._sid, name)] = [s._sid for s in self.states]
        tracer.streams[self.parent._sid].append(
            Node("join", mode,
                 deps=deps))


def trace(func: Any, params: list[str], arguments: dict[str, Any]) -> TracedProgram:
    """Trace ``func(s, **arguments)``; parameters in ``params`` not given become placeholders.
    Raises NotTraceable."""
    tracer = _Tracer()
    sid = tracer.new_stream(None)
    kwargs = {p: arguments[p] if p in arguments else tracer.arg(p) for p in params}
    func(TracerState(tracer, sid), **kwargs)
    return TracedProgram(tracer.streams, tracer.parents)
