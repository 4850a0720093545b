"""Grammar-constrained decoding on tiny random-weight models: whatever the logits, outputs match
the regex / validate against the schema / are one of the choices, for greedy and sampled
decoding; the mask never allows ids outside the tokenizer's vocabulary."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.constrained.spec import GrammarError, GrammarSpec, make_spec
from server.engine import Engine
from server.model.sampling import SamplingParams, SamplingParamsError

PADDED_VOCAB = 49152 + 96  # the tokenizer has 49152 tokens; the model pads its vocabulary


@pytest.fixture(scope="module")
def padded_engine(make_tiny_model):
    path, _ = make_tiny_model("llama", seed=3, vocab_size=PADDED_VOCAB)
    return Engine(path, dtype="float32", context_length=512, max_total_tokens=8192)


def _gen(engine, params, n=4):
    """n samples of one prompt (seeded requests get seeds seed, seed+1, ...)."""
    return engine.generate(input_ids=engine.encode("Answer:"), sampling_params={**params, "n": n})


REGEXES = st.sampled_from([r"[0-9]{1,4}", r"(yes|no|maybe)", r"[a-z]{2,6}-[0-9]{2}",
                           r"\d+\.\d{2}", r"(ab|cd)+e?", r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=REGEXES, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_regex_outputs_always_match(padded_engine, regex, temperature, seed):
    outs = _gen(padded_engine, {"regex": regex, "temperature": temperature, "seed": seed,
                                "max_new_tokens": 48})
    for o in outs:
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(regex, o["text"]), (regex, o["text"])
        else:  # cut by max_new_tokens: still a valid prefix, never an invalid character
            assert o["meta_info"]["finish_reason"]["type"] == "length"
        assert all(t < 49152 for t in o["output_ids"])


def _schemas():
    scalar = st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"type": "null"},
                              {"type": "string", "maxLength": 6},
                              {"type": "number"}, {"enum": ["red", "green", 3]},
                              {"const": "fixed"}])
    array = scalar.map(lambda s: {"type": "array", "items": s, "minItems": 1, "maxItems": 3})
    field = st.one_of(scalar, array)
    return st.dictionaries(st.sampled_from(["a", "bb", "name", "x_1"]), field, min_size=1,
                           max_size=3).map(lambda props: {
                               "type": "object", "properties": props,
                               "required": sorted(props), "additionalProperties": False})


# derandomize: the same 12 examples every run (a random draw once found the surrogate bug
# that test_constrained_text_never_encodes_a_surrogate now pins down)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas(), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_json_schema_outputs_always_validate(padded_engine, schema, temperature, seed):
    outs = _gen(padded_engine, {"json_schema": schema, "temperature": temperature, "seed": seed,
                                "max_new_tokens": 160})
    for o in outs:
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(o["text"]), schema)


def _byte_token(engine, byte: int) -> int:
    return next(i for i, b in enumerate(engine.grammars.info.decoded_vocab) if b == bytes([byte]))


@pytest.mark.parametrize("params", [{"json_schema": {"type": "string", "maxLength": 2}},
                                    {"regex": r"[^a-z]{1,2}"}, {"ebnf": 'root ::= [^a-z] [^a-z]?'}])
def test_constrained_text_never_encodes_a_surrogate(padded_engine, params):
    """xgrammar 0.2 accepts the bytes ED A0 80 (a UTF-16 surrogate, invalid UTF-8) as one
    character, which decodes as three U+FFFD. Biased toward exactly those bytes, the output
    stays valid UTF-8 and within the grammar: after ED only 80-9F may follow."""
    ed, a0, b0, quote = (_byte_token(padded_engine, b) for b in (0xED, 0xA0, 0x80, 0x22))
    bias = {str(ed): 100.0, str(a0): 90.0, str(b0): 80.0, str(quote): 95.0}  # '"' opens JSON
    out = padded_engine.generate(input_ids=padded_engine.encode("Answer:"), sampling_params={
        **params, "logit_bias": bias, "temperature": 0.0, "max_new_tokens": 16})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    raw = b"".join(padded_engine.grammars.info.decoded_vocab[t] for t in out["output_ids"]
                   if t in (ed, a0, b0))
    assert raw.startswith(b"\xed\x80"), raw  # ED taken, A0 refused after it
    assert "\ufffd" not in out["text"] and len(out["text"].strip('"')) <= 2, out["text"]
    if "json_schema" in params:
        jsonschema.validate(json.loads(out["text"]), params["json_schema"])


def test_choices_and_a_grammar_beating_logit_bias(padded_engine):
    # a +100 bias on a padded id and on EOS: the grammar still decides
    outs = _gen(padded_engine, {"choices": ["alpha", "beta", "gamma delta"], "temperature": 1.0,
                                "seed": 5, "logit_bias": {str(PADDED_VOCAB - 1): 100.0,
                                                          "2": 50.0}}, n=6)
    assert {o["text"] for o in outs} <= {"alpha", "beta", "gamma delta"}
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)


def test_mask_never_allows_padded_ids(padded_engine):
    m = padded_engine.grammars.matcher(make_spec(regex=r"[a-z]+"), sorted(padded_engine.eos_ids))
    mask = m.allowed_mask()
    assert mask.shape == (PADDED_VOCAB,) and not mask[49152:].any() and mask.any()


def test_compile_cache_compiles_once(padded_engine):
    spec = GrammarSpec("regex", "[0-9]{7}")
    g = padded_engine.grammars
    a = g.compile(spec)
    assert g.compile(spec) is a


@pytest.mark.parametrize("kwargs, param", [
    ({"regex": ""}, "regex"), ({"choices": []}, "choices"), ({"choices": ["a", "a"]}, "choices"),
    ({"json_schema": "{not json"}, "json_schema"), ({"json_schema": {"type": 5}}, "json_schema"),
    ({"json_schema": {"$defs": {"n": {"properties": {"next": {"$ref": "#/$defs/n"}}}},
                      "$ref": "#/$defs/n"}}, "json_schema"),
    ({"json_schema": {"type": "object", "description": "x" * 40000}}, "json_schema"),
    ({"regex": "a", "json_schema": {"type": "object"}}, "json_schema"),
])
def test_bad_specs_raise_typed_errors(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_uncompilable_regex_is_a_grammar_error(padded_engine):
    with pytest.raises(GrammarError):
        padded_engine.generate("x", {"regex": "(unclosed"})
    assert not padded_engine.scheduler.has_work


def test_matcher_failure_ends_only_that_request(padded_engine, monkeypatch):
    """A matcher that rejects a token mid-generation (a fault we cannot cause otherwise) ends
    only its request, with an error; the others in the batch finish normally."""
    prompt = padded_engine.encode("Answer:")
    bad = padded_engine.make_request(prompt, SamplingParams(regex="[a-z]+", max_new_tokens=8))
    monkeypatch.setattr(bad.grammar, "accept", lambda tok: False)
    good = padded_engine.make_request(prompt, bad.params)
    outs = padded_engine.run([bad, good])
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "error"
    assert outs[1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    padded_engine.scheduler.check_invariants()


def test_json_strings_never_hold_raw_control_characters(padded_engine):
    """xgrammar 0.2 admits raw control characters in strings with maxLength; our JSON-safe mask
    removes them. Bias the model hard towards the byte-level token for \\x07 (id 195)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}},
              "required": ["s"], "additionalProperties": False}
    outs = _gen(padded_engine, {"json_schema": schema, "temperature": 1.0, "seed": 2,
                                "max_new_tokens": 40, "logit_bias": {"195": 30.0, "199": 30.0}},
                n=6)
    for o in outs:
        assert 195 not in o["output_ids"] and 199 not in o["output_ids"]
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(o["text"]), schema)  # strict: no raw control chars


def test_slow_compiles_are_stopped_and_do_not_hold_up_quick_ones(padded_engine, monkeypatch):
    """Two grammars that take seconds to compile (one client's) and a trivial regex sent
    after them: the trivial one compiles at once (slow ones leave the fast lane after
    FAST_LANE_S), the slow ones are stopped at the budget and refused, and the compiler
    still works afterwards (its processes restarted)."""
    from server.constrained import grammar as g

    # the slow regexes took 0.9-1.4 s to compile on the fastest machine measured (Zen 5),
    # several seconds on others: over this budget everywhere
    monkeypatch.setattr(g, "COMPILE_TIMEOUT_S", 0.7)
    monkeypatch.setattr(g, "FAST_LANE_S", 0.2)
    compiler = g.GrammarCompiler(padded_engine.tokenizer, PADDED_VOCAB)
    try:
        compiler.compile(make_spec(regex="[0-9]"))  # the processes are up
        slow = [compiler.compile_async(make_spec(regex=r)) for r in
                ('[^"]{1,60000}', "[a-z0-9 ]{1,50000}")]
        start = time.monotonic()
        quick = compiler.compile_async(make_spec(regex="(yes|no)"))
        quick.result(timeout=5)
        assert time.monotonic() - start < 2.0  # behind the first slow one for FAST_LANE_S
        for f, spec in zip(slow, ('[^"]{1,60000}', "[a-z0-9 ]{1,50000}")):
            with pytest.raises(GrammarError, match="took over"):
                g.GrammarCompiler.result(f, make_spec(regex=spec), 10)
        assert time.monotonic() - start < 5.0  # stopped at the budget, not left running
        assert compiler._lanes["slow"][1].restarts >= 1
        assert compiler.compile(make_spec(regex="[a-c]{2}")) is not None
    finally:
        compiler.close()


def test_the_compiled_grammar_cache_is_bounded(padded_engine, monkeypatch):
    from server.constrained import grammar as g

    compiler = g.GrammarCompiler(padded_engine.tokenizer, PADDED_VOCAB)
    try:
        first = compiler.compile(make_spec(regex="[0-9]{3}"))
        monkeypatch.setattr(g, "CACHE_BYTES", 2 * first.memory_size_bytes)
        for i in range(6):
            compiler.compile(make_spec(regex=f"[0-9]{{{i + 4}}}"))
        assert len(compiler._cache) <= 3 and compiler.cache_bytes <= g.CACHE_BYTES + \
            max(c.memory_size_bytes for c in compiler._cache.values())
        assert make_spec(regex="[0-9]{3}") not in compiler._cache  # least recently used out
    finally:
        compiler.close()


def test_a_compiled_grammar_is_cached_when_compile_returns(padded_engine, monkeypatch):
    """A waiter on a future wakes before the future's callbacks run: with the cache filled by
    a callback, compile() could return while the cache was still being updated (CI once saw
    its byte count include an entry already evicted). Callbacks slowed down here, the cache
    must still hold the grammar, and exactly its entries' bytes, when compile() returns."""
    from server.constrained import grammar as g

    finished = g.GrammarCompiler._finished

    def late(self, spec, future):
        time.sleep(0.2)
        finished(self, spec, future)

    monkeypatch.setattr(g.GrammarCompiler, "_finished", late)
    compiler = g.GrammarCompiler(padded_engine.tokenizer, PADDED_VOCAB)
    try:
        first = compiler.compile(make_spec(regex="[0-9]{3}"))
        monkeypatch.setattr(g, "CACHE_BYTES", 2 * first.memory_size_bytes)
        for i in range(4):
            spec = make_spec(regex=f"[0-9]{{{i + 4}}}")
            compiled = compiler.compile(spec)
            assert compiler._cache.get(spec) is compiled
            assert compiler.cache_bytes == sum(c.memory_size_bytes
                                               for c in compiler._cache.values())
    finally:
        compiler.close()


@pytest.mark.parametrize("spec", [
    make_spec(regex="a{300}b(c|d)ef{20}"),
    make_spec(json_schema={"type": "object", "properties": {
        "name": {"enum": ["x" * 200, "y"]}, "n": {"type": "integer"}}, "required": ["name"]}),
])
def test_the_cached_forced_string_equals_xgrammars(padded_engine, spec):
    """The matcher walks a forced string as tokens are accepted and rolled back; at every
    state it must equal what xgrammar computes from scratch."""
    import random

    compiler = padded_engine.grammars
    for seed in range(3):
        m = compiler.matcher(spec, [0])
        fresh = compiler.matcher(spec, [0])._m  # an uncached twin, driven the same way
        rng = random.Random(seed)
        accepted = 0
        for _ in range(300):
            assert m.jump_forward_string() == fresh.find_jump_forward_string()
            if accepted and rng.random() < 0.2:
                n = rng.randint(1, min(accepted, 5))
                m.rollback(n)
                fresh.rollback(n)
                accepted -= n
                continue
            allowed = [t for t in m.allowed_mask().nonzero().flatten().tolist() if t != 0]
            if not allowed:
                break
            tok = rng.choice(allowed)
            assert m.accept(tok) and fresh.accept_token(tok)
            accepted += 1


@pytest.mark.parametrize("spec", [
    make_spec(regex=r"[a-z]{2,6}-[0-9]{2}( and [a-z]+)?"),
    make_spec(json_schema={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta gamma"]}}},
        "required": ["name", "n", "tags"]}),
])
def test_greedy_rows_skip_the_mask_only_where_it_cannot_change_the_token(padded_engine, spec):
    """Sampler.sample asks the grammar about a greedy row's best token (Matcher.allows) and
    masks only where it is not allowed: along random walks through the grammar, allows()
    equals the bitmask's bit for every allowed token and a sample of the others, and each
    greedy token equals the argmax over the fully masked logits, on logits that favour
    allowed tokens (shortcut taken) and disallowed ones (mask needed)."""
    import random

    import torch

    from server.model.sampling import Sampler, SamplingState

    eos = sorted(padded_engine.eos_ids)
    sampler = Sampler()
    samples = fills = sampling = 0
    for seed in range(2):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        m = padded_engine.grammars.matcher(spec, eos)
        fill = m.fill_bitmask

        def counted(bitmask, row, fill=fill):
            nonlocal fills
            fills += sampling  # allowed_mask() fills too
            fill(bitmask, row)

        m.fill_bitmask = counted
        for _ in range(40):
            mask = m.allowed_mask()
            allowed = mask.nonzero().flatten().tolist()
            others = rng.sample(range(PADDED_VOCAB), 300)
            assert all(m.allows(t) for t in allowed)
            assert [m.allows(t) for t in others] == [bool(mask[t]) for t in others]
            for favour in (allowed, others):
                logits = torch.randn(1, PADDED_VOCAB, generator=gen)
                logits[0, rng.choice(favour)] += 50.0
                state = SamplingState(SamplingParams(temperature=0), [1], [], None, grammar=m)
                sampling = 1
                tok = sampler.sample(logits, [state]).next_ids[0]
                sampling, samples = 0, samples + 1
                assert tok == int(logits[0].masked_fill(~mask, float("-inf")).argmax())
            allowed = [t for t in allowed if t not in eos]
            if not allowed:
                break
            assert m.accept(rng.choice(allowed))
    assert 0 < fills < samples  # the mask was skipped where the best token was allowed
