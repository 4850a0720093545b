"""SamplingParams: a request's sampling settings, immutable and validated, with no torch (the
HTTP process builds and checks them; the scheduler's sampler, :mod:`server.model.sampling`,
applies them).

Semantics follow the OpenAI API and vLLM/SGLang where they differ from HF:
  * ``temperature == 0`` is greedy (argmax of the processed logits);
  * frequency/presence penalties count *output* tokens (OpenAI); the repetition penalty (HF/CTRL
    style: divide positive logits, multiply negative ones) applies to prompt and output tokens;
  * ``top_k`` of -1 or 0 disables top-k; ``min_p`` keeps tokens with p >= min_p * p_max;
  * logprobs are of the *raw* model distribution (log_softmax of the unprocessed logits), so
    they are comparable across sampling settings and usable for choice scoring;
  * a request's ``seed`` seeds its own generator, advanced once per sampled token, so its
    samples do not depend on what else is in the batch.

Errors: :class:`SamplingParamsError` (a ``ValueError``) names the field and its accepted range.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import regex

from server.constrained.spec import GrammarError, GrammarSpec, make_spec

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
_INT64 = (-(1 << 63), (1 << 63) - 1)


# SGLang sampling fields accepted and ignored (see SamplingParams.from_sglang)
SGLANG_IGNORED = ("spaces_between_special_tokens", "stream_interval", "custom_params")


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` is its name (for OpenAI-style errors)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request. Lengths are in tokens.

    Construct directly or with :meth:`from_dict` (e.g. an API's ``sampling_params``); derive
    variants with ``dataclasses.replace``. Every field is validated on construction.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # regular expressions (Python ``re``) whose first match in the output ends it like a stop
    # string (SGLang's name)
    stop_regex: tuple[str, ...] = ()
    no_stop_trim: bool = False  # keep the matched stop string / regex match in the text
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    # constraints (at most one): a regex, a JSON schema (dict or JSON text; stored as canonical
    # JSON text), or a list of allowed completions
    regex: str | None = None
    json_schema: Any = None
    choices: tuple[str, ...] | None = None
    ebnf: str | None = None  # an EBNF grammar (SGLang's name), "root ::= ..."

    def __post_init__(self) -> None:
        # one check per field, in field order, each naming its field: long by design (a split
        # would only scatter them)
        def need(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(field, msg)

        # Accept lists/dicts from JSON; store hashable tuples.
        for name in ("stop", "stop_regex"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
            elif getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.logit_bias, Mapping):
            try:
                items = tuple((int(k), v) for k, v in self.logit_bias.items())
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias", "keys must be token ids (integers)")
            object.__setattr__(self, "logit_bias", items)
        for name in ("stop", "stop_regex", "stop_token_ids", "logit_bias"):
            value = getattr(self, name)
            need(isinstance(value, (list, tuple)), name, "must be a list")
            object.__setattr__(self, name, tuple(value))

        need(_is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens",
             f"must be an integer >= 0, got {self.max_new_tokens!r}")
        need(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
             "min_new_tokens", f"must be an integer in [0, max_new_tokens], got "
             f"{self.min_new_tokens!r}")
        need(_is_number(self.temperature) and self.temperature >= 0, "temperature",
             f"must be a finite number >= 0, got {self.temperature!r}")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
             f"must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and self.top_k >= -1, "top_k",
             f"must be an integer >= -1 (-1 or 0 disables), got {self.top_k!r}")
        need(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
             f"must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(_is_number(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        need(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
             "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        need(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
             f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for tok, bias in self.logit_bias:
            need(_is_int(tok) and tok >= 0, "logit_bias", f"token id {tok!r} must be >= 0")
            need(_is_number(bias) and -100 <= bias <= 100, "logit_bias",
                 f"bias {bias!r} for token {tok} must be in [-100, 100]")
        need(self.seed is None or (_is_int(self.seed) and _INT64[0] <= self.seed <= _INT64[1]),
             "seed", f"must be a 64-bit signed integer, got {self.seed!r}")
        need(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            need(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop",
                 f"each stop string must be a non-empty string of at most "
                 f"{MAX_STOP_STRING_CHARS} characters")
        need(len(self.stop_regex) <= MAX_STOP_STRINGS, "stop_regex",
             f"at most {MAX_STOP_STRINGS} patterns")
        for pattern in self.stop_regex:
            need(isinstance(pattern, str) and 0 < len(pattern) <= MAX_STOP_STRING_CHARS,
                 "stop_regex", f"each pattern must be a non-empty string of at most "
                 f"{MAX_STOP_STRING_CHARS} characters")
            try:
                regex.compile(pattern)  # the engine server.detokenizer searches with
            except regex.error as exc:
                raise SamplingParamsError("stop_regex", f"{pattern!r} is not a valid regular "
                                          f"expression: {exc}") from exc
        need(isinstance(self.no_stop_trim, bool), "no_stop_trim", "must be a boolean")
        need(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        need(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "must be a boolean")
        need(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]")
        if isinstance(self.choices, list):
            object.__setattr__(self, "choices", tuple(self.choices))
        try:
            spec = make_spec(self.regex, self.json_schema, self.choices, self.ebnf)
        except GrammarError as exc:
            raise SamplingParamsError(exc.param, str(exc).split(": ", 1)[-1]) from exc
        if spec is not None and spec.kind == "json_schema":
            object.__setattr__(self, "json_schema", spec.spec)
        object.__setattr__(self, "_grammar", spec)

    @property
    def grammar(self) -> GrammarSpec | None:
        """The normalized constraint, or None."""
        return self._grammar

    @classmethod
    def from_sglang(cls, d: Mapping[str, Any] | None) -> "SamplingParams":
        """From SGLang's ``sampling_params`` (its frontend and clients send its whole set):
        ``sampling_seed`` is ``seed``; the cosmetic ``spaces_between_special_tokens``
        (fast tokenizers have no such switch) and ``stream_interval`` (streams are coalesced
        here anyway) and ``custom_params`` (inert without a custom logit processor, which
        /generate refuses) are accepted and ignored; ``structural_tag`` is refused. Raises
        SamplingParamsError."""
        d = dict(d or {})
        for name in SGLANG_IGNORED:
            d.pop(name, None)
        if d.get("structural_tag") is not None:
            raise SamplingParamsError("structural_tag", "structural tags are not supported; "
                                      "use json_schema, regex or ebnf")
        d.pop("structural_tag", None)
        if "sampling_seed" in d:
            seed = d.pop("sampling_seed")
            d.setdefault("seed", seed)
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, *, ignore_unknown: bool = False
                  ) -> "SamplingParams":
        """Build from a dict of field names. Unknown keys raise SamplingParamsError unless
        ``ignore_unknown``; None values mean "default"."""
        d = {k: v for k, v in (d or {}).items() if v is not None}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown and not ignore_unknown:
            raise SamplingParamsError(unknown[0], "unknown sampling parameter")
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: the argmax is taken."""
        return self.temperature == 0.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary. Raises SamplingParamsError."""
        for tok, _ in self.logit_bias:
            if tok >= vocab_size:
                raise SamplingParamsError("logit_bias", f"token id {tok} >= vocab size {vocab_size}")
        for tok in self.stop_token_ids:
            if tok >= vocab_size:
                raise SamplingParamsError("stop_token_ids",
                                          f"token id {tok} >= vocab size {vocab_size}")


