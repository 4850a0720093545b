"""The interpreter: each program state is an asynchronous stream (SGLang paper §2, "the
interpreter").

A :class:`StreamExecutor` owns one worker thread and a queue. ``s += expr`` only enqueues, so
the Python program keeps running (building prompts, forking, starting other states) while the
server generates; ``s[name]`` blocks until that variable exists. A failure (server down, a 400
for a bad regex) is stored on the stream: later expressions are skipped, ``s.error()`` returns
it and reading a variable that was never produced raises :class:`ProgramError` — nothing hangs.

``s.fork(n)`` waits for the stream to catch up, sends the prefix once as a cache hint
(prefill-only), and starts n streams that continue from a copy of the state; ``join`` gathers
the variables they produced back into the parent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from typing import Any, AsyncIterator, Iterator

from sgl_adapters.backends.base import Backend, GenCall, GenResult
from sgl_adapters.lang import ir, speculative
from sgl_adapters.lang.scopes import RoleScopes, StateGroup

_END = object()


class ProgramError(RuntimeError):
    """A program's stream failed; ``__cause__`` is the original error."""


class StreamExecutor:
    """Executes expressions of one state in order on a worker thread.

    Args:
        backend: where gen/select run.
        defaults: sampling keywords given to ``run`` (a gen's own keywords win).
        stream: use the backend's streaming API so ``text_iter`` sees chunks as they arrive.
        num_api_spec_tokens: API speculative execution budget (tokens), or None.
    """

    def __init__(self, backend: Backend, defaults: ir.SamplingArgs, stream: bool = False,
                 num_api_spec_tokens: int | None = None):
        self.backend, self.defaults, self.stream = backend, defaults, stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.images: list[Any] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.chunks: dict[str, list[str]] = {}
        self.error: BaseException | None = None
        self.role: str | None = None
        self.role_start = 0
        self.spec_buffer = ""
        self.spec_ended = False  # the buffer ends where the model ended (EOS)
        self.finished = False  # the program will submit nothing more
        self.children: list[StreamExecutor] = []  # forks, ended with this stream
        self.calls = 0  # gen/select calls this program made (forks count their parent's)
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sgl-stream")
        self._thread.start()

    # -- queue ---------------------------------------------------------------------------------
    def submit(self, expr: ir.Expr) -> None:
        """Queue ``expr`` for this stream's worker. Raises ProgramError once the program has
        ended."""
        with self._cond:
            if self.finished:
                raise ProgramError("this state's program has ended; append before run() returns")
            self._pending += 1
        self._queue.put(expr)

    def end(self) -> None:
        """No more expressions: the worker (and those of forks) exits once its queue drains."""
        with self._cond:
            if self.finished:
                return
            self.finished = True
            self._cond.notify_all()
        self._queue.put(_END)
        for child in self.children:
            child.end()

    def fail(self, error: BaseException) -> None:
        """Record the stream's first error (later expressions are skipped) and wake waiters."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def sync(self) -> None:
        """Block until every submitted expression has run (or been skipped after an error)."""
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def _run(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                return
            try:
                if self.error is None:
                    self._execute(expr)
            except BaseException as exc:  # noqa: BLE001 - stored, re-raised on access
                self.fail(exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def wait_var(self, name: str) -> Any:
        """The value of ``name`` once produced. Raises ProgramError if the stream failed first,
        KeyError if the program never produces it."""
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self._pending == 0
                                or self.error is not None)
            if name in self.variables:
                return self.variables[name]
            if self.error is not None:
                raise ProgramError(f"the program failed before producing {name!r}: "
                                   f"{self.error}") from self.error
            raise KeyError(name)

    def _append(self, text: str, var: str | None = None) -> None:
        with self._cond:
            self.text += text
            if var is not None:
                self.chunks.setdefault(var, []).append(text)
            self._cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            self._cond.notify_all()

    # -- execution -----------------------------------------------------------------------------
    def _execute(self, expr: ir.Expr) -> None:
        if isinstance(expr, ir.Concat):
            for leaf in ir.flatten(expr):
                self._execute(leaf)
        elif isinstance(expr, ir.Text):
            if self.spec_buffer:
                self.spec_buffer = speculative.consume_text(self.spec_buffer, expr.value)
            self._append(expr.value)
        elif isinstance(expr, ir.Gen):
            self._gen(expr)
        elif isinstance(expr, ir.Select):
            result = self.backend.select(self._call(ir.SamplingArgs()), expr.choices,
                                         expr.method, expr.temperature)
            self._append(result.choice, expr.name)
            self._set_var(expr.name, ir.convert(result.choice, expr.dtype), result.meta)
            self.spec_buffer = ""
        elif isinstance(expr, ir.RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, ir.RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, ir.Image):
            self.images.append(expr.data)
            # where the image goes in a text prompt: the server's image token (multimodal
            # servers report it; elsewhere the image travels without a marker)
            token = getattr(self.backend, "image_token", None)
            if token:
                self._append(token)
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _call(self, sampling: ir.SamplingArgs) -> GenCall:
        prefix = self.text[self.role_start:] if self.role == "assistant" else None
        self.calls += 1
        return GenCall(self.text, sampling, tuple(self.messages), tuple(self.images), prefix,
                       priority=self.calls - 1)

    def _gen(self, expr: ir.Gen) -> None:
        sampling = expr.sampling.merged(self.defaults)
        value = self._speculate(sampling) if self.num_api_spec_tokens else None
        if value is not None:
            text, meta = value, {"speculative": True}
            self._append(text, expr.name)
        elif self.stream:
            result = None
            for item in self.backend.generate_stream(self._call(sampling)):
                if isinstance(item, GenResult):
                    result = item
                else:
                    self._append(item, expr.name)
            text, meta = result.text, result.meta
        else:
            result = self.backend.generate(self._call(sampling))
            text, meta = result.text, result.meta
            self._append(text, expr.name)
        self._set_var(expr.name, ir.convert(text, expr.dtype), meta)

    def _speculate(self, sampling: ir.SamplingArgs) -> str | None:
        """The gen's value from the speculation buffer (one API call fills it), or None for a
        normal call: constrained gens, gens without a stop, and a buffer without the stop."""
        stops = sampling.stops()
        if (sampling.regex is not None or sampling.json_schema is not None
                or sampling.ebnf is not None or not stops):
            self.spec_buffer = ""
            return None
        if not self.spec_buffer:
            budget = max(self.num_api_spec_tokens, sampling.max_tokens or 0)
            wide = dataclasses.replace(sampling, stop=None, max_tokens=budget)
            result = self.backend.generate(self._call(wide))
            self.spec_buffer, self.spec_ended = result.text, _ended_by_eos(result.meta)
        taken = speculative.take_gen(self.spec_buffer, stops, self.spec_ended)
        if taken is None:
            self.spec_buffer = ""
            return None
        value, self.spec_buffer = taken
        return value

    def _role_begin(self, role: str) -> None:
        if role not in ir.ROLES:
            raise ValueError(f"unknown role {role!r}")
        if self.role is not None:
            raise ValueError(f"{role} turn begun inside an open {self.role} turn")
        template = self.backend.chat_template
        if not self.messages and role != "system" and not self.text:
            self._append(template.default_system)
        self._append(template.prefix(role))
        self.role, self.role_start = role, len(self.text)

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(f"{role} turn ended but the open turn is {self.role}")
        content = self.text[self.role_start:]
        self._append(self.backend.chat_template.suffix(role))
        self.messages.append({"role": role, "content": content})
        self.role, self.spec_buffer = None, ""

    def copy(self) -> StreamExecutor:
        """A new stream continuing from this one's state (for fork). Call after sync()."""
        child = StreamExecutor(self.backend, self.defaults, self.stream, self.num_api_spec_tokens)
        child.text, child.messages, child.images = self.text, list(self.messages), list(self.images)
        child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
        child.role, child.role_start, child.calls = self.role, self.role_start, self.calls
        self.children.append(child)
        return child


class ProgramState(RoleScopes):
    """The ``s`` of a program: append with ``+=``, read variables with ``s[name]``, open a
    role with ``with s.user(): ...``."""

    def __init__(self, executor: StreamExecutor):
        self._ex = executor

    def _submit(self, expr: ir.Expr) -> None:
        self._ex.submit(expr)

    def __iadd__(self, other: Any) -> ProgramState:
        self._ex.submit(ir.to_expr(other))
        return self

    def __getitem__(self, name: str) -> Any:
        return self._ex.wait_var(name)

    def get_var(self, name: str) -> Any:
        """As ``s[name]``: the variable's value, once generated (blocks until then)."""
        return self._ex.wait_var(name)

    def set_var(self, name: str, value: Any) -> None:
        """Set variable ``name`` after everything queued so far has run."""
        self._ex.sync()
        self._ex.variables[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """Server meta info of variable ``name`` (tokens, cached_tokens, finish_reason, logprobs;
        for select: the scores). Blocks like ``s[name]``."""
        self._ex.wait_var(name)
        return self._ex.meta_info.get(name)

    def sync(self) -> ProgramState:
        """Wait until everything queued so far has run."""
        self._ex.sync()
        return self

    def text(self) -> str:
        """The whole text so far (prompt and generations, role markers included)."""
        self._ex.sync()
        return self._ex.text

    def messages(self) -> list[dict[str, str]]:
        """The completed chat turns ``[{"role", "content"}]``."""
        self._ex.sync()
        return list(self._ex.messages)

    def error(self) -> BaseException | None:
        """The error that ended the program (a BackendError, a failed conversion), else None."""
        self._ex.sync()
        return self._ex.error

    def variables(self) -> dict[str, Any]:
        """Every variable set so far, by name."""
        self._ex.sync()
        return dict(self._ex.variables)

    def fork(self, size: int) -> ProgramStateGroup:
        """``size`` states continuing from this one. The shared prefix is sent once as a cache
        hint first. Raises ProgramError if this state has already failed."""
        self._ex.sync()
        if self._ex.error is not None:
            raise ProgramError(f"cannot fork a failed state: {self._ex.error}") from self._ex.error
        if size > 1:
            self._ex.backend.cache_prefix(self._ex.text)
        return ProgramStateGroup(self, [ProgramState(self._ex.copy()) for _ in range(size)])

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Text as it is generated: of variable ``name`` until it is complete, or (no name) of
        the whole state until the program ends. Raises ProgramError if the stream fails."""
        ex, pos = self._ex, 0
        while True:
            with ex._cond:
                ex._cond.wait_for(lambda: _available(ex, name) > pos or _done(ex, name)
                                  or ex.error is not None)
                text = "".join(ex.chunks.get(name, ())) if name is not None else ex.text
                done, error = _done(ex, name), ex.error
            if len(text) > pos:
                yield text[pos:]
                pos = len(text)
            elif error is not None:
                raise ProgramError(str(error)) from error
            elif done:
                return

    async def text_async_iter(self, name: str | None = None) -> AsyncIterator[str]:
        """``async for chunk in s.text_async_iter(name)``: :meth:`text_iter` off the event loop."""
        it = self.text_iter(name)
        while True:
            chunk = await asyncio.to_thread(next, it, None)
            if chunk is None:
                return
            yield chunk

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


def _ended_by_eos(meta: dict[str, Any]) -> bool:
    """finish_reason "stop" of a call sent without stop strings: the model's end of sequence
    (native API: {"type": "stop"}; OpenAI API: "stop")."""
    reason = meta.get("finish_reason")
    return (reason.get("type") if isinstance(reason, dict) else reason) == "stop"


def _available(ex: StreamExecutor, name: str | None) -> int:
    return len(ex.text) if name is None else sum(len(c) for c in ex.chunks.get(name, ()))


def _done(ex: StreamExecutor, name: str | None) -> bool:
    if name is None:
        return ex.finished and ex._pending == 0
    return name in ex.variables or ex._pending == 0


class ProgramStateGroup(StateGroup):
    """The states made by :meth:`ProgramState.fork`; ``forks += expr`` appends to each."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]):
        super().__init__(parent, states)
        self._start = {id(s): (len(s._ex.text), set(s._ex.variables)) for s in states}

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every fork and bring results back to the parent. ``gather_variable``: each
        variable a fork created becomes a list (one value per fork) on the parent;
        ``concate_and_append``: the forks' new text is appended to the parent's text. Raises
        ProgramError if a fork failed, ValueError for an unknown mode."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"unknown join mode {mode!r}")
        for s in self.states:
            s._ex.sync()
            if s._ex.error is not None:
                raise ProgramError(f"a fork failed: {s._ex.error}") from s._ex.error
        parent = self.parent._ex
        parent.sync()
        with parent._cond:
            if mode == "gather_variable":
                names = []
                for s in self.states:
                    names += [n for n in s._ex.variables
                              if n not in self._start[id(s)][1] and n not in names]
                for n in names:
                    parent.variables[n] = [s._ex.variables.get(n) for s in self.states]
                    parent.meta_info[n] = [s._ex.meta_info.get(n) for s in self.states]
            else:
                parent.text += "".join(s._ex.text[self._start[id(s)][0]:] for s in self.states)
            # the parent's next call comes after its forks' calls (GenCall.priority)
            parent.calls = max([parent.calls, *(s._ex.calls for s in self.states)])
            parent._cond.notify_all()
        for s in self.states:
            s._ex.end()
