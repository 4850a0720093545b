"""Compile regex / JSON-schema / choice constraints into token-level automata for one tokenizer.

Library choice: **xgrammar** (Apache-2.0, used by SGLang, vLLM and TensorRT-LLM). It compiles
JSON schemas and regexes to a pushdown automaton with precomputed token masks over the model's
*padded* vocabulary (ids past the tokenizer's vocabulary are never allowed), supports rollback
and ``find_jump_forward_string`` (the forced continuation a compressed FSM appends in one step,
SGLang paper §4), and applies masks on CPU tensors. JSON is generated with fixed separators
(", " and ": "), so whitespace cannot loop and keys are forced strings.
outlines-core was the alternative; it lacks rollback and a jump-forward query.

Specs are checked and normalized first (:mod:`server.constrained.spec`). Compiled grammars
are cached per (kind, spec), least recently used out past ``CACHE_BYTES``: a batch with one
schema compiles once. A compile not done ``COMPILE_TIMEOUT_S`` after it was asked for is
stopped and refused. Compiles run in child processes
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

Errors: :class:`~server.constrained.spec.GrammarError`, answered as HTTP 400.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import re
import threading
import time
from typing import Any, Sequence

from server.constrained.compile_worker import CompileProcess
from server.constrained.matcher import Matcher, PackedMask
from server.constrained.spec import GrammarError, GrammarSpec

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
        self._utf8 = None
        self._packed: dict[bool, tuple[PackedMask, PackedMask]] = {}  # json_schema or not

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
                compiled = self._xgr.CompiledGrammar.deserialize_json(payload, self.info)
            except Exception as exc:  # noqa: BLE001
                future.set_exception(exc)
            else:
                # cached before the result is published: a waiter wakes before the future's
                # callbacks run, so a cache filled by a callback could still be mid-update
                # (its size counted, its evictions not yet) when compile() returned
                self._store(spec, compiled)
                future.set_result(compiled)
            if len(payload) >= TRIM_AFTER_BYTES:
                del payload
                _trim_heap()
        elif status == "empty":
            future.set_exception(GrammarError(spec.kind, payload))
        else:
            future.set_exception(RuntimeError(payload))

    def _store(self, spec: GrammarSpec, compiled: Any) -> None:
        """Cache ``compiled``, evicting the least recently used past CACHE_BYTES."""
        with self._lock:
            self._cache[spec] = compiled
            self.cache_bytes += compiled.memory_size_bytes
            while self.cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self.cache_bytes -= old.memory_size_bytes

    def _finished(self, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        with self._lock:  # compiled (and cached) or failed: later requests start afresh
            # only this future's entry: callbacks run after waiters wake, and by then the spec
            # may have been evicted and a new compile of it registered
            if self._inflight.get(spec) is future:
                del self._inflight[spec]

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
            self._json_safe = self._token_mask(rb"[\x00-\x1f]", past_vocab=False)
        return self._json_safe

    def utf8_masks(self):
        """(no_surrogate, after_ed): two [vocab_size] bool masks that keep constrained text
        valid UTF-8 where xgrammar 0.2 does not.

        xgrammar's byte automaton accepts ED A0-BF xx, the UTF-8 encoding of a UTF-16
        surrogate (U+D800-DFFF), which RFC 3629 section 3 forbids and Python decodes as three
        U+FFFD: a ``maxLength`` string or a regex then no longer matches its text. It does
        refuse overlong forms and lone continuation bytes. ``no_surrogate`` drops tokens that
        hold such a sequence whole (every grammar's mask is ANDed with it); ``after_ed`` drops
        tokens that start with a continuation byte A0-BF (ANDed when the text so far ends in
        the lead byte ED; see :class:`Matcher`)."""
        if self._utf8 is None:
            self._utf8 = (self._token_mask(rb"\xed[\xa0-\xbf]", past_vocab=True),
                          self._token_mask(rb"\A[\xa0-\xbf]", past_vocab=True))
        return self._utf8

    def _token_mask(self, pattern: bytes, past_vocab: bool):
        """[vocab_size] bool: tokens whose bytes do not match ``pattern``; ids past the
        tokenizer's vocabulary (padding, which has no bytes) are ``past_vocab``."""
        import torch

        bad = re.compile(pattern)
        safe = [bad.search(t if isinstance(t, bytes) else str(t).encode()) is None
                for t in self._token_bytes[:self.vocab_size]]
        safe += [past_vocab] * (self.vocab_size - len(safe))
        return torch.tensor(safe, dtype=torch.bool)

    def matcher(self, spec: GrammarSpec, stop_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher for one request; EOS (``stop_token_ids``) is allowed exactly when
        the automaton accepts."""
        compiled = self.compile(spec)
        m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        is_json = spec.kind == "json_schema"
        if is_json not in self._packed:  # packed once per kind, shared by every matcher
            no_surrogate, after_ed = self.utf8_masks()
            self._packed[is_json] = (PackedMask(no_surrogate & self.json_safe_mask() if is_json
                                                else no_surrogate), PackedMask(after_ed))
        extra, after_ed = self._packed[is_json]
        return Matcher(m, self._xgr, self.vocab_size, extra, self._token_bytes, after_ed)


def _over_budget(spec: GrammarSpec) -> GrammarError:
    return GrammarError(spec.kind, f"compiling took over {COMPILE_TIMEOUT_S:.0f} s")
