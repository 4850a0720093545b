"""``@sgl.function``: a Python function whose first parameter is the program state.

``fn.run(...)`` runs it once and returns the :class:`ProgramState`; ``fn.run_batch([...])``
runs many concurrently (a thread pool; each program's generations run on its own stream) after
sending the constant prefix found by :mod:`~sgl_adapters.lang.tracer` once as a cache hint;
``fn.trace(...)`` returns the dataflow graph; ``fn.bind(...)`` fixes arguments. Calling a
function with a state as first argument runs it inside another program (nesting).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from sgl_adapters.backends.base import Backend
from sgl_adapters.lang import ir
from sgl_adapters.lang.interpreter import ProgramState, StreamExecutor
from sgl_adapters.lang.tracer import NotTraceable, TracedProgram, trace

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(ir.SamplingArgs)}


class DefaultBackend:
    """Holder of the backend used when ``run`` gets none (``sgl.set_default_backend``)."""

    backend: Backend | None = None


def set_default_backend(backend: Backend) -> None:
    """Use ``backend`` (a RuntimeEndpoint, Runtime or OpenAI) when ``run`` is given none."""
    DefaultBackend.backend = backend


def _resolve(backend: Backend | None) -> Backend:
    backend = backend or DefaultBackend.backend
    if backend is None:
        raise RuntimeError("no backend: pass backend= or call sgl.set_default_backend(...)")
    return backend


def sampling_from_kwargs(kwargs: dict[str, Any]) -> ir.SamplingArgs:
    """SamplingArgs from run()'s keywords (``max_new_tokens`` is accepted for max_tokens).
    Raises TypeError for an unknown keyword."""
    kw = dict(kwargs)
    if "max_new_tokens" in kw:
        kw["max_tokens"] = kw.pop("max_new_tokens")
    unknown = set(kw) - _SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown keyword(s) {sorted(unknown)}: not a program argument or a "
                        "sampling keyword")
    if isinstance(kw.get("stop"), list):
        kw["stop"] = tuple(kw["stop"])
    return ir.SamplingArgs(**kw)


class SglFunction:
    """A program. ``num_api_spec_tokens``: API speculative execution budget (OpenAI backend)."""

    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None,
                 bound: dict[str, Any] | None = None):
        self.func, self.num_api_spec_tokens = func, num_api_spec_tokens
        self.bound = dict(bound or {})
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"{func.__name__}: the first parameter must be the state `s`")
        self.params = params[1:]
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bound, **kwargs})

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        """Run inside another program on its state (nested programs)."""
        return self.func(state, *args, **{**self.bound, **kwargs})

    def _split(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict, ir.SamplingArgs]:
        if len(args) > len(self.params):
            raise TypeError(f"{self.__name__}() takes {len(self.params)} arguments")
        arguments = {**self.bound, **dict(zip(self.params, args))}
        rest = {}
        for k, v in kwargs.items():
            (arguments if k in self.params else rest)[k] = v
        return arguments, sampling_from_kwargs(rest)

    def run(self, *args: Any, stream: bool = False, backend: Backend | None = None,
            **kwargs: Any) -> ProgramState:
        """Run once. Keywords that are not parameters are sampling defaults for every gen
        (max_tokens/max_new_tokens, temperature, stop, ...). Returns the state, finished unless
        ``stream=True``. A Python exception in the program body propagates; generation errors
        are on the state (``s.error()``)."""
        arguments, sampling = self._split(args, kwargs)
        return self._run(arguments, sampling, _resolve(backend), stream)

    def _run(self, arguments: dict, sampling: ir.SamplingArgs, backend: Backend,
             stream: bool, raise_errors: bool = True) -> ProgramState:
        executor = StreamExecutor(backend, sampling, stream, self.num_api_spec_tokens)
        state = ProgramState(executor)
        try:
            self.func(state, **arguments)
        except Exception as exc:
            executor.fail(exc)
            if raise_errors:
                raise
        finally:
            executor.end()
        if not stream:
            executor.sync()
        return state

    def run_batch(self, batch_kwargs: list[dict[str, Any]], num_threads: int | str = "auto",
                  progress_bar: bool = True, backend: Backend | None = None,
                  **sampling_kwargs: Any) -> list[ProgramState]:
        """Run once per dict of arguments, concurrently; states in input order. A program that
        raises has the exception on its state (``s.error()``) and the batch goes on."""
        backend = _resolve(backend)
        sampling = sampling_from_kwargs(sampling_kwargs)
        if num_threads == "auto":
            num_threads = max(1, min(len(batch_kwargs), 64, 4 * (os.cpu_count() or 1)))
        prefix = self.constant_prefix(backend)
        if prefix and len(batch_kwargs) > 1:
            backend.cache_prefix(prefix)

        def one(kwargs: dict[str, Any]) -> ProgramState:
            return self._run({**self.bound, **kwargs}, sampling, backend, False, False)

        with ThreadPoolExecutor(int(num_threads)) as pool:
            futures = pool.map(one, batch_kwargs)
            if progress_bar:
                from tqdm.auto import tqdm

                futures = tqdm(futures, total=len(batch_kwargs), desc=self.__name__)
            return list(futures)

    def trace(self, **kwargs: Any) -> TracedProgram:
        """The dataflow graph; arguments not given are placeholders. Raises NotTraceable."""
        return trace(self.func, self.params, {**self.bound, **kwargs})

    def constant_prefix(self, backend: Backend) -> str:
        """The text every run starts with, or "" when the program is not traceable."""
        try:
            traced = self.trace()
        except NotTraceable:
            return ""
        return traced.constant_prefix(backend.chat_template)


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None):
    """Decorator: ``@sgl.function`` or ``@sgl.function(num_api_spec_tokens=64)``."""
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens)
