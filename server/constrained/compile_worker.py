"""Grammar compiles in child processes, so one that runs over its budget can be stopped.

xgrammar compiles in C++ and cannot be interrupted: on a thread, an over-budget compile (a
~30 KB EBNF grammar takes ~20 s, ``[^"]{1,20000}`` 3.5 s) kept running after its requester
gave up, and two of them took the whole pool. Here each compile runs in a :class:`CompileProcess`
(forked from a ``forkserver`` that has xgrammar loaded, so a fresh one starts in ~0.1 s) and
returns the compiled grammar serialized (``CompiledGrammar.serialize_json``); a compile past
its time is stopped by killing its process, which is restarted for the next one.

The scheduling of compiles over two such processes (a multi-level feedback queue) lives in
:class:`server.constrained.grammar.GrammarCompiler`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
from typing import Any

_CONTEXT: Any = None
_CONTEXT_LOCK = threading.Lock()
MAX_CHILD_RSS_BYTES = 384 << 20  # a child past this after a compile is replaced (its heap
# keeps what large grammars took; a fresh fork shares the forkserver's pages again)


class NoStringError(ValueError):
    """The grammar matches no string (its first-token mask is empty, EOS included)."""


def choices_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    def lit(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
            .replace("\r", "\\r").replace("\t", "\\t") + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


def compile_grammar(compiler: Any, xgr: Any, kind: str, spec: str, vocab_size: int) -> Any:
    """xgrammar's CompiledGrammar for a GrammarSpec's (kind, spec). Raises NoStringError, or
    the library's error for an invalid spec."""
    if kind == "regex":
        compiled = compiler.compile_regex(spec)
    elif kind == "json_schema":
        # Fixed separators (", " and ": "): no whitespace loops, and keys plus separators
        # become forced strings that jump-forward computes in one pass.
        compiled = compiler.compile_json_schema(spec, any_whitespace=False)
    elif kind == "ebnf":
        compiled = compiler.compile_grammar(spec)
    else:
        compiled = compiler.compile_grammar(choices_ebnf(json.loads(spec)))
    # A grammar that matches no string (regex [^\s\S], an EBNF with no finite derivation)
    # allows no first token, not even EOS: refused here, it would end its request with
    # "the grammar rejected token ..." after a wasted prefill.
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bitmask.any():
        raise NoStringError("matches no string: no token can start it")
    return compiled


def _serve(conn, info_json: str, vocab_size: int) -> None:
    """The child: compile (kind, spec) pairs until the pipe closes; answer ("ok", serialized
    grammar), ("empty", message) or ("error", the library's message). It runs at a lower
    priority (nice +10): on a machine with few cores a stream of slow compiles must not take
    CPU time from the decode steps of running requests."""
    import xgrammar as xgr

    os.nice(10)
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            reply = ("ok", compile_grammar(compiler, xgr, kind, spec, vocab_size)
                     .serialize_json())
        except NoStringError as exc:
            reply = ("empty", str(exc))
        except Exception as exc:  # noqa: BLE001 - the library's message goes to the client
            reply = ("error", str(exc))
        conn.send(reply)


def _context():
    """A forkserver context whose server has xgrammar imported (~2-4 s, once per process)."""
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["xgrammar"])
            _CONTEXT = ctx
        return _CONTEXT


def _rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class CompileProcess:
    """One child process compiling grammars, one at a time (use from one thread).

    Args: info_json: ``xgr.TokenizerInfo.serialize_json()`` of the model's tokenizer;
    vocab_size: the model's (padded) vocabulary size.
    """

    def __init__(self, info_json: str, vocab_size: int):
        self.info_json, self.vocab_size = info_json, vocab_size
        self._proc = None
        self._conn = None
        self.restarts = 0  # compiles stopped over their budget

    def compile(self, kind: str, spec: str, timeout: float) -> tuple[str, str]:
        """(status, payload) of compiling (kind, spec): ("ok", serialized CompiledGrammar),
        ("empty", message) or ("error", message). Raises TimeoutError after ``timeout``
        seconds (the compile is stopped: its process killed)."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((kind, spec))
        if not self._conn.poll(max(timeout, 0.0)):
            self.close()
            self.restarts += 1
            raise TimeoutError(f"compile over {timeout:.1f} s")
        try:
            reply = self._conn.recv()
        except EOFError as exc:  # the child died (out of memory, a crash in the library)
            self.close()
            return "error", f"the compiler process exited ({exc or 'no reply'})"
        if _rss_bytes(self._proc.pid) > MAX_CHILD_RSS_BYTES:
            self.close()
        return reply

    def _start(self) -> None:
        ctx = _context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.info_json, self.vocab_size),
                           daemon=True, name="grammar-compile")
        try:
            proc.start()  # kept only once started: close() joins what it holds
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self._proc, self._conn = proc, parent

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._conn.close()
        self._proc = self._conn = None
