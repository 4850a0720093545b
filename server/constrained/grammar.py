"""Compile regex / JSON-schema / choice constraints into token-level automata for one tokenizer.

Library choice: **xgrammar** (Apache-2.0, used by SGLang, vLLM and TensorRT-LLM). It compiles
JSON schemas and regexes to a pushdown automaton with precomputed token masks over the model's
*padded* vocabulary (ids past the tokenizer's vocabulary are never allowed), supports rollback
and ``find_jump_forward_string`` (the forced continuation a compressed FSM appends in one step,
SGLang paper §4), and applies masks on CPU tensors. JSON is generated with fixed separators
(", " and ": "), so whitespace cannot loop and keys are forced strings.
outlines-core was the alternative; it lacks rollback and a jump-forward query.

User JSON schemas are first checked with ``jsonschema`` (draft 2020-12) so errors are clear.
Compiled grammars are cached per (kind, spec), least recently used out past
``CACHE_BYTES``: a batch with one schema compiles once. Budgets: specs over ``MAX_SPEC_CHARS``
and recursive schemas are refused; a compile not done ``COMPILE_TIMEOUT_S`` after it was asked
for is stopped and refused. Compiles run in child processes
(:mod:`server.constrained.compile_worker`) scheduled as a two-level feedback queue
(:meth:`GrammarCompiler.compile_async`): every compile starts in the *fast lane* with
``FAST_LANE_S``; one that takes longer is stopped there and restarted in the *slow lane* with
what is left of its budget. Most grammars compile in milliseconds, so the fast lane is never
held long: one client's slow grammars queue behind each other, not in front of everyone's
(two ~20 s grammars took both compile threads and made trivial regexes sent after them fail).
The scheduler parks a request while its grammar compiles and keeps serving the others.
After a large compiled grammar is loaded the heap's free memory is given back to the OS
(``malloc_trim``, ~10 ms): loading one parses a serialized copy several times its size in the
compile thread's malloc arena, and evicted grammars left holes there. The slow-grammar soak
client's scheduler held 615 MB for a full cache (start 330), now 430.

Errors: :class:`GrammarError` (a ValueError with ``param``), answered as HTTP 400.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec

from server.constrained.compile_worker import CompileProcess
from server.constrained.matcher import Matcher

MAX_SPEC_CHARS = 32 * 1024
MAX_SCHEMA_TEXT_CHARS = 4 * MAX_SPEC_CHARS  # a schema given as text, before its whitespace goes
MAX_EBNF_CHARS = 512 * 1024  # grounding grammars of long passages (~25 chars per word)
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 64  # dict/list levels
COMPILE_TIMEOUT_S = 10.0
FAST_LANE_S = 1.0  # a compile longer than this moves to the slow lane
CACHE_BYTES = 64 << 20  # compiled grammars kept (xgrammar's estimate; resident ~2x this)
TRIM_AFTER_BYTES = 1 << 20  # serialized grammars at least this long: trim the heap after loading


try:
    _LIBC = ctypes.CDLL(None)
except OSError:  # pragma: no cover - a platform without a C library to load
    _LIBC = None


def _trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; no-op elsewhere).
    ctypes releases the GIL for the call."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


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


# xgrammar prefixes its errors with a time and its C++ source location:
# "[14:12:45] /project/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 16: ..."
_LIBRARY_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|cpp|h|hpp|py):\d+:\s*)?")


def _library_message(exc: Exception) -> str:
    """The compiler's message for a client: without the library's timestamp and source path
    (which say nothing about the request and describe the server's build)."""
    return _LIBRARY_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and model vocabulary size.

    Args: tokenizer (transformers), vocab_size (the model's, possibly padded, vocabulary).
    Call :meth:`close` to stop the compile processes (also done when it is collected).
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        info_json = self.info.serialize_json()
        self._token_bytes = self.info.decoded_vocab  # a fresh list per property read
        self._cache: collections.OrderedDict[GrammarSpec, Any] = collections.OrderedDict()
        self.cache_bytes = 0
        self._inflight: dict[GrammarSpec, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        # one thread and one compile process per lane; each thread drives only its process
        self._lanes = {name: (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"grammar-{name}"), CompileProcess(info_json, vocab_size))
            for name in ("fast", "slow")}
        self.compile_seconds = 0.0
        self._json_safe = None

    def compile_async(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar for ``spec``, never blocking: done at once on a
        cache hit; requests for a spec already compiling share its future. It fails with
        GrammarError when the spec does not compile or is not compiled ``COMPILE_TIMEOUT_S``
        after this call (the compile is then stopped)."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(hit)
                return done
            future = self._inflight.get(spec)
            if future is not None:
                return future
            future = self._inflight[spec] = concurrent.futures.Future()
        future.add_done_callback(lambda f: self._finished(spec, f))
        deadline = time.monotonic() + COMPILE_TIMEOUT_S
        self._lanes["fast"][0].submit(self._run, "fast", spec, deadline, future)
        return future

    def _run(self, lane: str, spec: GrammarSpec, deadline: float,
             future: concurrent.futures.Future) -> None:
        """Compile ``spec`` on ``lane``'s process within its share of the budget; a fast-lane
        compile over FAST_LANE_S moves to the slow lane."""
        left = deadline - time.monotonic()
        budget = min(left, FAST_LANE_S) if lane == "fast" else left
        if budget <= 0:  # waited its whole budget in the queue
            return future.set_exception(_over_budget(spec))
        start = time.perf_counter()
        try:
            status, payload = self._lanes[lane][1].compile(spec.kind, spec.spec, budget)
        except TimeoutError:
            if lane == "fast" and budget < left:
                self._lanes["slow"][0].submit(self._run, "slow", spec, deadline, future)
            else:
                future.set_exception(_over_budget(spec))
            return
        except Exception as exc:  # noqa: BLE001 - the pipe broke: the requester gets the reason
            return future.set_exception(exc)
        finally:
            self.compile_seconds += time.perf_counter() - start
        if status == "ok":
            try:
                future.set_result(self._xgr.CompiledGrammar.deserialize_json(payload,
                                                                             self.info))
            except Exception as exc:  # noqa: BLE001
                future.set_exception(exc)
            if len(payload) >= TRIM_AFTER_BYTES:
                del payload
                _trim_heap()
        elif status == "empty":
            future.set_exception(GrammarError(spec.kind, payload))
        else:
            future.set_exception(RuntimeError(payload))

    def _finished(self, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.pop(spec, None)
            if future.exception() is not None:
                return
            compiled = future.result()
            self._cache[spec] = compiled
            self.cache_bytes += compiled.memory_size_bytes
            while self.cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self.cache_bytes -= old.memory_size_bytes

    def close(self) -> None:
        """Stop the compile threads and processes (idempotent)."""
        for pool, proc in self._lanes.values():
            pool.shutdown(wait=True, cancel_futures=True)
            proc.close()

    def __del__(self) -> None:
        for pool, proc in getattr(self, "_lanes", {}).values():
            pool.shutdown(wait=False, cancel_futures=True)
            proc.close()

    def compile(self, spec: GrammarSpec):
        """The compiled grammar for ``spec`` (cached), waiting up to ``COMPILE_TIMEOUT_S``.
        Raises GrammarError."""
        return self.result(self.compile_async(spec), spec, COMPILE_TIMEOUT_S + 1)

    @staticmethod
    def result(future: concurrent.futures.Future, spec: GrammarSpec, timeout: float):
        """The compiled grammar of a :meth:`compile_async` future, waiting up to ``timeout``
        seconds. Raises GrammarError (compile error, or over the budget)."""
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise _over_budget(spec) from exc
        except GrammarError:
            raise
        except Exception as exc:  # the library's own message names the problem
            raise GrammarError(spec.kind, f"cannot compile: {_library_message(exc)}") from exc

    def json_safe_mask(self):
        """[vocab_size] bool: tokens whose bytes hold no control character (< 0x20).

        JSON generated with fixed separators never contains a raw control character (inside
        strings they must be escaped), but xgrammar 0.2's rule for strings with ``maxLength``
        admits them (all but \\n and \\r); JSON-schema masks are ANDed with this mask."""
        if self._json_safe is None:
            import torch

            control = re.compile(rb"[\x00-\x1f]")
            safe = [control.search(t if isinstance(t, bytes) else str(t).encode()) is None
                    for t in self._token_bytes[:self.vocab_size]]
            safe += [False] * (self.vocab_size - len(safe))  # ids past the tokenizer's vocabulary
            self._json_safe = torch.tensor(safe, dtype=torch.bool)
        return self._json_safe

    def matcher(self, spec: GrammarSpec, stop_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher for one request; EOS (``stop_token_ids``) is allowed exactly when
        the automaton accepts."""
        compiled = self.compile(spec)
        m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        extra = self.json_safe_mask() if spec.kind == "json_schema" else None
        return Matcher(m, self._xgr, self.vocab_size, extra, self._token_bytes)


def _over_budget(spec: GrammarSpec) -> GrammarError:
    return GrammarError(spec.kind, f"compiling took over {COMPILE_TIMEOUT_S:.0f} s")
