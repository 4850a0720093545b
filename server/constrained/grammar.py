"""Compile regex / JSON-schema / choice constraints into token-level automata for one tokenizer.

Library choice: **xgrammar** (Apache-2.0, used by SGLang, vLLM and TensorRT-LLM). It compiles
JSON schemas and regexes to a pushdown automaton with precomputed token masks over the model's
*padded* vocabulary (ids past the tokenizer's vocabulary are never allowed), supports rollback
and ``find_jump_forward_string`` (the forced continuation a compressed FSM appends in one step,
SGLang paper §4), and applies masks on CPU tensors. JSON is generated with fixed separators
(", " and ": "), so whitespace cannot loop and keys are forced strings.
outlines-core was the alternative; it lacks rollback and a jump-forward query.

User JSON schemas are first checked with ``jsonschema`` (draft 2020-12) so errors are clear.
Compiled grammars are cached per (kind, spec): a batch with one schema compiles once. Budgets:
specs over ``MAX_SPEC_CHARS`` and recursive schemas are refused; a compile taking longer than
``COMPILE_TIMEOUT_S`` is refused (the worker thread is left to finish in the background, and its
result is cached). Compiles run on worker threads (:meth:`GrammarCompiler.compile_async`): the
scheduler parks a request while its grammar compiles and keeps serving the others.

Errors: :class:`GrammarError` (a ValueError with ``param``), answered as HTTP 400.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

MAX_SPEC_CHARS = 32 * 1024
MAX_SCHEMA_TEXT_CHARS = 4 * MAX_SPEC_CHARS  # a schema given as text, before its whitespace goes
MAX_EBNF_CHARS = 512 * 1024  # grounding grammars of long passages (~25 chars per word)
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 64  # dict/list levels
COMPILE_TIMEOUT_S = 10.0


class GrammarError(ValueError):
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
                text = json.dumps(json_schema, separators=(",", ":"))
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


def _choices_ebnf(choices: list[str]) -> str:
    def lit(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") \
            .replace("\r", "\\r").replace("\t", "\\t") + '"'

    return "root ::= " + " | ".join(lit(c) for c in choices)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and model vocabulary size.

    Args: tokenizer (transformers), vocab_size (the model's, possibly padded, vocabulary).
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: dict[GrammarSpec, Any] = {}
        self._inflight: dict[GrammarSpec, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        # Two workers: one over-budget compile (left to finish) does not block the next.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self.compile_seconds = 0.0
        self._json_safe = None

    def compile_async(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar for ``spec``, never blocking: done at once on a
        cache hit; requests for a spec already compiling share its future. A compile that
        finishes (even after its requester gave up waiting) lands in the cache. xgrammar
        releases the GIL while it compiles, so the caller's thread keeps running."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(hit)
                return done
            future = self._inflight.get(spec)
            if future is not None:
                return future
            future = self._pool.submit(self._timed_compile, spec)
            self._inflight[spec] = future
        future.add_done_callback(lambda f: self._finished(spec, f))
        return future

    def _timed_compile(self, spec: GrammarSpec):
        start = time.perf_counter()
        try:
            return self._compile(spec)
        finally:
            self.compile_seconds += time.perf_counter() - start

    def _finished(self, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._inflight.pop(spec, None)
            if future.exception() is None:
                self._cache[spec] = future.result()

    def compile(self, spec: GrammarSpec):
        """The compiled grammar for ``spec`` (cached), waiting up to ``COMPILE_TIMEOUT_S``.
        Raises GrammarError."""
        return self.result(self.compile_async(spec), spec, COMPILE_TIMEOUT_S)

    @staticmethod
    def result(future: concurrent.futures.Future, spec: GrammarSpec, timeout: float):
        """The compiled grammar of a :meth:`compile_async` future, waiting up to ``timeout``
        seconds. Raises GrammarError (compile error, or over the budget)."""
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError as exc:
            raise GrammarError(spec.kind, f"compiling took over {COMPILE_TIMEOUT_S:.0f} s") from exc
        except GrammarError:
            raise
        except Exception as exc:  # the library's own message names the problem
            raise GrammarError(spec.kind, f"cannot compile: {_library_message(exc)}") from exc

    def _compile(self, spec: GrammarSpec):
        c = self._compiler
        if spec.kind == "regex":
            compiled = c.compile_regex(spec.spec)
        elif spec.kind == "json_schema":
            # Fixed separators (", " and ": "): no whitespace loops, and keys plus separators
            # become forced strings that jump-forward computes in one pass.
            compiled = c.compile_json_schema(spec.spec, any_whitespace=False)
        elif spec.kind == "ebnf":
            compiled = c.compile_grammar(spec.spec)
        else:
            compiled = c.compile_grammar(_choices_ebnf(json.loads(spec.spec)))
        # A grammar that matches no string (regex [^\s\S], an EBNF with no finite derivation)
        # allows no first token, not even EOS: refused here, it would end its request with
        # "the grammar rejected token ..." after a wasted prefill.
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise GrammarError(spec.kind, "matches no string: no token can start it")
        return compiled

    def json_safe_mask(self):
        """[vocab_size] bool: tokens whose bytes hold no control character (< 0x20).

        JSON generated with fixed separators never contains a raw control character (inside
        strings they must be escaped), but xgrammar 0.2's rule for strings with ``maxLength``
        admits them (all but \\n and \\r); JSON-schema masks are ANDed with this mask."""
        if self._json_safe is None:
            import torch

            control = re.compile(rb"[\x00-\x1f]")
            safe = [control.search(t if isinstance(t, bytes) else str(t).encode()) is None
                    for t in self.info.decoded_vocab[:self.vocab_size]]
            safe += [False] * (self.vocab_size - len(safe))  # ids past the tokenizer's vocabulary
            self._json_safe = torch.tensor(safe, dtype=torch.bool)
        return self._json_safe

    def matcher(self, spec: GrammarSpec, stop_token_ids: Sequence[int]) -> "Matcher":
        """A fresh matcher for one request; EOS (``stop_token_ids``) is allowed exactly when
        the automaton accepts."""
        compiled = self.compile(spec)
        m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        extra = self.json_safe_mask() if spec.kind == "json_schema" else None
        return Matcher(m, self._xgr, self.vocab_size, extra)


def pack_bitmask(mask):
    """[V] bool -> [ceil(V / 32)] int32 in xgrammar's bitmask layout."""
    import torch

    words = -(-mask.numel() // 32)
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[:mask.numel()] = mask.to(torch.int64)
    packed = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class Matcher:
    """One request's cursor in its grammar."""

    def __init__(self, matcher: Any, xgr: Any, vocab_size: int, extra_mask: Any = None):

        self._m = matcher
        self.vocab_size = vocab_size
        # ANDed with the grammar's bitmask (see json_safe_mask), packed the same way
        self._extra_bits = None if extra_mask is None else pack_bitmask(extra_mask)
        self._xgr = xgr

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask`` [B, ceil(V / 32)]
        int32 (xgrammar's layout: bit j of word w = token 32 * w + j)."""
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._extra_bits is not None:
            bitmask[row] &= self._extra_bits

    def allowed_mask(self):
        """[vocab_size] bool tensor of the tokens the grammar allows next."""
        import torch

        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        self.fill_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(-1)[:self.vocab_size].bool()

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (state unchanged) if the grammar rejects it."""
        return bool(self._m.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """True once a stop token was accepted in an accepting state: the output is done."""
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        """The string the grammar forces from the current state ("" when there is a choice)."""
        return self._m.find_jump_forward_string()
