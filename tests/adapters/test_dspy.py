"""The DSPy adapter with real dspy (3.4.x) against a live bundled server on the default model."""

from __future__ import annotations

import asyncio
import enum
import uuid
from typing import Literal

import pydantic
import pytest

dspy = pytest.importorskip("dspy")

from sgl_adapters.dspy import SGLangLM  # noqa: E402
from sgl_adapters.dspy.lowering import plan_fields  # noqa: E402

pytestmark = pytest.mark.default_model


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class City(pydantic.BaseModel):
    name: str
    country: str


class Typed(dspy.Signature):
    """Extract facts from the text."""

    text: str = dspy.InputField()
    sentiment: Literal["positive", "negative"] = dspy.OutputField()
    is_question: bool = dspy.OutputField()
    year: int = dspy.OutputField()
    score: float = dspy.OutputField()
    color: Color = dspy.OutputField()
    city: City = dspy.OutputField()
    tags: list[str] = dspy.OutputField()


TEXTS = ["I loved my trip to Paris in 2019, the sky was so blue.",
         "Was the 1998 Rome marathon a disaster?", "Berlin in 2021 was grey and cold.",
         "What a wonderful red sunset over Madrid in 2005!"]


@pytest.fixture
def lm(default_server):
    lm = SGLangLM(base_url=default_server.url, cache=False, temperature=0.0, max_tokens=64)
    with dspy.context(lm=lm, adapter=None):
        yield lm


def _assert_typed(pred) -> None:
    assert pred.sentiment in ("positive", "negative")
    assert isinstance(pred.is_question, bool) and isinstance(pred.year, int)
    assert isinstance(pred.score, float) and isinstance(pred.color, Color)
    assert isinstance(pred.city, City) and isinstance(pred.tags, list)


def test_lowering_recognises_chat_adapter_requests():
    msgs = dspy.ChatAdapter().format(Typed, [], {"text": "x"})
    fields = plan_fields(msgs[0]["content"], msgs[-1]["content"])
    kinds = {f.name: (f.kind, f.choices) for f in fields}
    assert [f.name for f in fields] == list(Typed.output_fields)
    assert kinds["sentiment"] == ("select", ("positive", "negative"))
    assert kinds["is_question"] == ("select", ("True", "False"))
    assert kinds["year"][0] == "int" and kinds["score"][0] == "float"
    assert kinds["color"] == ("select", ("red", "blue"))
    assert kinds["city"][0] == "json" and kinds["tags"][0] == "json"
    cot = dspy.ChatAdapter().format(dspy.ChainOfThought(Typed).predict.signature, [], {"text": "x"})
    assert plan_fields(cot[0]["content"], cot[-1]["content"])[0].name == "reasoning"
    assert plan_fields("no skeleton", "Respond with whatever") is None


def test_predict_and_chain_of_thought_typed(lm):
    pred = dspy.Predict(Typed)(text=TEXTS[0])
    _assert_typed(pred)
    usage = lm.history[-1]["usage"]
    assert usage["prompt_tokens"] > 100 and usage["completion_tokens"] > 0
    cot = dspy.ChainOfThought(Typed)(text=TEXTS[1])
    _assert_typed(cot)
    assert isinstance(cot.reasoning, str)
    assert len(lm.history) == 2  # one call each: no JSONAdapter fallback


def test_few_shot_demos_share_the_prefix(lm):
    qa = dspy.Predict("question -> answer: Literal['yes', 'no']")
    qa.demos = [dspy.Example(question="Is fire cold?", answer="no"),
                dspy.Example(question="Is ice cold?", answer="yes")]
    first = qa(question="Is the sun hot?")
    second = qa(question="Is snow hot?")
    assert {first.answer, second.answer} <= {"yes", "no"}
    assert lm.history[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 100


@pytest.mark.slow
def test_typed_outputs_always_parse_over_12_calls(lm):
    program = dspy.Predict(Typed)
    examples = [dspy.Example(text=f"{TEXTS[i % 4]} (note {i})").with_inputs("text")
                for i in range(12)]
    preds = program.batch(examples, num_threads=12, max_errors=0)
    assert len(preds) == 12
    for p in preds:
        _assert_typed(p)
    assert len(lm.history) == 12  # exactly one LM call per example: no fallback calls


def test_batch_of_16_computes_the_prefix_once(lm):
    program = dspy.Predict("question -> answer: Literal['yes', 'no']")
    program.demos = [dspy.Example(question=f"Is {x} a number?", answer="yes" if x.isdigit()
                                  else "no") for x in ("7", "cat", "42", "blue")]
    engine = lm.sglang_engine
    sent = engine.hints.sent
    examples = [dspy.Example(question=f"Is item {i} a number?").with_inputs("question")
                for i in range(16)]
    preds = program.batch(examples, num_threads=8)
    assert all(p.answer in ("yes", "no") for p in preds)
    assert engine.hints.sent == sent + 1  # the shared prefix was hinted once
    usages = [h["usage"] for h in lm.history[-16:]]
    prompt = min(u["prompt_tokens"] for u in usages)
    # Every call, the first ones included, found instructions + skeleton + demos cached: only
    # its last user turn (question and the output-format reminder, ~80 tokens) was new.
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert min(cached) > 0.75 * prompt


def test_async_and_streaming(lm):
    program = dspy.Predict("question -> answer: Literal['yes', 'no'], detail: str")

    async def run_async():
        return await program.acall(question="Is water wet?")

    pred = asyncio.run(run_async())
    assert pred.answer in ("yes", "no")

    streaming = dspy.streamify(program, stream_listeners=[
        dspy.streaming.StreamListener(signature_field_name="detail")])

    async def collect():
        chunks, final = [], None
        async for item in streaming(question="Is the sea salty?"):
            if isinstance(item, dspy.streaming.StreamResponse):
                chunks.append(item.chunk)
            elif isinstance(item, dspy.Prediction):
                final = item
        return chunks, final

    chunks, final = asyncio.run(collect())
    assert final is not None and final.answer in ("yes", "no")
    assert chunks and "".join(chunks).strip() == final.detail.strip()


def test_evaluate_small_devset(lm):
    devset = [dspy.Example(question=q, answer=a).with_inputs("question") for q, a in
              [("Is Paris in France?", "yes"), ("Is Rome in Spain?", "no"),
               ("Is Berlin in Germany?", "yes"), ("Is Madrid in Italy?", "no")]]
    program = dspy.Predict("question -> answer: Literal['yes', 'no']")
    result = dspy.Evaluate(devset=devset, metric=lambda ex, pred, trace=None: ex.answer == pred.answer,
                           num_threads=2, display_progress=False)(program)
    assert len(result.results) == 4
    assert all(pred.answer in ("yes", "no") for _, pred, _ in result.results)  # lowered select
    correct = sum(bool(score) for _, _, score in result.results)
    assert result.score == pytest.approx(100 * correct / 4)


def test_lowering_off_is_plain_chat_adapter(default_server):
    from dspy.lm15 import Config, Message, Request

    msgs = dspy.ChatAdapter().format(dspy.Signature("question -> answer: Literal['yes', 'no']"),
                                     [], {"question": "Is the sky blue?"})
    request = Request(model="default", system=msgs[0]["content"],
                      messages=(Message.user(msgs[-1]["content"]),), config=Config(max_tokens=48))
    on = SGLangLM(base_url=default_server.url, cache=False, temperature=0.0, max_tokens=48)
    off = SGLangLM(base_url=default_server.url, cache=False, temperature=0.0, max_tokens=48,
                   lowering=False)
    assert on.engine._plan(request) is not None and off.engine._plan(request) is None
    lowered = on.engine.complete(request).text
    assert lowered.startswith("[[ ## answer ## ]]\n") and lowered.endswith("[[ ## completed ## ]]")
    # Off: one free-text chat completion, whatever the model writes (it is not rebuilt from
    # markers, so it generally differs from the lowered text).
    plain = off.engine.complete(request)
    assert plain.usage.output_tokens > 0 and plain.text != lowered


def test_json_adapter_schema_is_enforced(default_server):
    lm = SGLangLM(base_url=default_server.url, cache=False, temperature=0.0, max_tokens=96,
                  lowering=False)
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        pred = dspy.Predict("text -> city: City, year: int")(text=TEXTS[2])
    assert isinstance(pred.city, City) and isinstance(pred.year, int)
    assert len(lm.history) == 1


def test_save_and_load_program_holding_the_lm(lm, tmp_path):
    program = dspy.Predict("question -> answer: Literal['yes', 'no']")
    program.set_lm(lm)
    path = tmp_path / "program.json"
    program.save(str(path), save_program=False)
    loaded = dspy.Predict("question -> answer: Literal['yes', 'no']")
    loaded.load(str(path), allow_unsafe_lm_state=True)
    assert loaded(question="Is ice cold?").answer in ("yes", "no")
    assert loaded.lm.engine.base_url == lm.engine.base_url


def test_server_errors_become_dspy_errors(default_server):
    """An unreachable server is DSPy's LMTransportError (retryable by DSPy's own policy); a
    request the server refuses is its LMInvalidRequestError (not retried)."""
    from dspy.utils.exceptions import LMInvalidRequestError, LMTransportError

    lm = SGLangLM(base_url="http://127.0.0.1:9", cache=False, num_retries=0, timeout=5)
    with dspy.context(lm=lm, adapter=None), pytest.raises(LMTransportError) as info:
        dspy.Predict("q -> a: int")(q="1+1?")
    assert "127.0.0.1:9" in str(info.value) or "connect" in str(info.value).lower()
    lm = SGLangLM(base_url=default_server.url, cache=False, num_retries=0)
    with dspy.context(lm=lm, adapter=None), pytest.raises(LMInvalidRequestError) as info:
        dspy.Predict("q -> a: int")(q="one plus one? " * 4000)  # over the context length
    assert "context length" in str(info.value)


def test_n_candidates_and_logprobs(default_server):
    lm = SGLangLM(base_url=default_server.url, cache=False, temperature=0.8, max_tokens=32)
    with dspy.context(lm=lm, adapter=None):
        pred = dspy.Predict("question -> answer: Literal['yes', 'no']", n=3)(question="Is ice cold?")
    assert len(pred.completions.answer) == 3
    assert all(a in ("yes", "no") for a in pred.completions.answer)
    plain = SGLangLM(base_url=default_server.url, cache=False, temperature=0.0, max_tokens=8,
                     lowering=False)
    out = plain("Say hi", logprobs=True, top_logprobs=2)
    assert out and isinstance(out[0], dict) and out[0]["logprobs"] is not None


def _finished(url: str) -> int:
    import httpx

    return httpx.get(url + "/server_info").json()["metrics"]["finished_requests"]


def test_acall_concurrently_from_async_code(lm):
    """Eight calls gathered on one event loop (DSPy 3.4 has no abatch): all answer, and the
    sync ``batch`` also works when called from a coroutine (it runs its own threads)."""
    program = dspy.Predict("question -> answer: Literal['yes', 'no']")
    questions = [f"Is {n} an even number?" for n in range(8)]

    async def main():
        preds = await asyncio.gather(*[program.acall(question=q) for q in questions])
        batch = program.batch([dspy.Example(question=q).with_inputs("question")
                               for q in questions[:4]], num_threads=4,
                              disable_progress_bar=True)
        return preds, batch

    preds, batch = asyncio.run(main())
    assert [p.answer in ("yes", "no") for p in preds] == [True] * 8
    assert len(batch) == 4 and all(p.answer in ("yes", "no") for p in batch)


def test_best_of_n_rollouts_are_distinct_requests(default_server):
    """BestOfN with a reward that is never met: N rollouts, each a real server request (its
    rollout id keeps DSPy's cache from answering), sampled at temperature 1."""
    lm = SGLangLM(base_url=default_server.url, cache=True, max_tokens=16)
    answers = []

    def reward(args, pred):
        answers.append(pred.answer)
        return 0.0

    before = _finished(default_server.url)
    with dspy.context(lm=lm, adapter=None):
        # a question of its own: DSPy's on-disk cache outlives this test run
        dspy.BestOfN(dspy.Predict("question -> answer"), N=3, reward_fn=reward,
                     threshold=1.0)(question=f"Name a color ({uuid.uuid4().hex[:8]}).")
    assert len(answers) == 3
    assert _finished(default_server.url) - before >= 3
    assert len(set(answers)) >= 2  # sampled, not one cached answer three times


def test_usage_tracking_reports_cached_tokens(default_server):
    lm = SGLangLM(base_url=default_server.url, cache=False, temperature=0, max_tokens=16)
    program = dspy.Predict("question -> answer: Literal['yes', 'no']")
    with dspy.context(lm=lm, adapter=None, track_usage=True):
        program(question="Is the sky blue?")
        pred = program(question="Is the sky blue?")
    usage = pred.get_lm_usage()
    (model_usage,) = usage.values()
    assert model_usage["prompt_tokens"] > 0
    details = model_usage.get("prompt_tokens_details") or {}
    assert details.get("cached_tokens", 0) > 0, usage


def test_bootstrap_few_shot_candidates_share_their_demo_prefixes(default_server):
    """BootstrapFewShot compiles on a small train set; evaluating the compiled program (its
    demos are one shared prefix) is served mostly from the radix cache."""
    import httpx

    lm = SGLangLM(base_url=default_server.url, cache=False, temperature=0, max_tokens=16)
    facts = [("Is Paris in France?", "yes"), ("Is Rome in Spain?", "no"),
             ("Is Berlin in Germany?", "yes"), ("Is Madrid in Italy?", "no"),
             ("Is Oslo in Norway?", "yes"), ("Is Lima in Chile?", "no")]
    train = [dspy.Example(question=q, answer=a).with_inputs("question") for q, a in facts]
    program = dspy.Predict("question -> answer: Literal['yes', 'no']")
    with dspy.context(lm=lm, adapter=None):
        compiled = dspy.BootstrapFewShot(
            metric=lambda ex, pred, trace=None: ex.answer == pred.answer,
            max_bootstrapped_demos=2, max_labeled_demos=2).compile(program, trainset=train)
        assert compiled.demos
        httpx.post(default_server.url + "/flush_cache")
        before = httpx.get(default_server.url + "/server_info").json()["metrics"]
        dev = [dspy.Example(question=f"Is {c} in Europe?").with_inputs("question")
               for c in ("Vienna", "Tokyo", "Prague", "Cairo", "Dublin", "Quito")]
        preds = compiled.batch(dev, num_threads=3, disable_progress_bar=True)
        after = httpx.get(default_server.url + "/server_info").json()["metrics"]
    assert all(p.answer in ("yes", "no") for p in preds)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    print(f"compiled-program hit rate {cached / prompt:.3f} ({cached}/{prompt} tokens)")
    assert cached / prompt > 0.5, (cached, prompt)


class Assess(dspy.Signature):
    """Answer the question about the text."""

    text: str = dspy.InputField()
    question: str = dspy.InputField()
    answer: Literal["yes", "no"] = dspy.OutputField()
    confidence: float = dspy.OutputField()


def test_openai_backend_one_call_per_module_fields_checked(default_server):
    """backend="openai" against our /v1 as a generic endpoint: a 3-output-field ChainOfThought
    is one call per module (the json_schema response format makes every field valid), no
    DSPy fallback call, and the usage is accounted."""
    lm = SGLangLM("default", base_url=default_server.url + "/v1", backend="openai",
                  cache=False, temperature=0, max_tokens=96)
    program = dspy.ChainOfThought(Assess)
    texts = ["The shop opens at nine and closes at five.", "Paris is the capital of France."]
    before = _finished(default_server.url)
    with dspy.context(lm=lm, track_usage=True):
        preds = [program(text=t, question="Is it about a city?") for t in texts]
    assert _finished(default_server.url) - before == 2
    assert len(lm.history) == 2  # no JSONAdapter fallback
    for pred in preds:
        assert pred.answer in ("yes", "no") and isinstance(pred.confidence, float)
        assert isinstance(pred.reasoning, str)
    usage = list(preds[-1].get_lm_usage().values())[0]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
