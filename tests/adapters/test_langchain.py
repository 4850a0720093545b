"""ChatSGLang with real langchain-core against a live bundled server on the default model:
LangChain's own standard test suites, plus structured output, tools and batch prefix reuse."""

from __future__ import annotations

import pydantic
import pytest

pytest.importorskip("langchain_core")
langchain_tests = pytest.importorskip("langchain_tests")

from langchain_core.exceptions import OutputParserException  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from sgl_adapters.langchain import ChatSGLang  # noqa: E402


class TestChatSGLangUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict:
        return {"model": "default", "temperature": 0}

    @property
    def init_from_env_params(self):
        return ({"SGLANG_API_KEY": "secret"}, {}, {"api_key": "secret"})


@pytest.mark.default_model
class TestChatSGLangIntegration(ChatModelIntegrationTests):
    url = ""

    @pytest.fixture(autouse=True)
    def _server(self, default_server):
        type(self).url = default_server.url

    @property
    def chat_model_class(self):
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict:
        return {"model": "default", "base_url": self.url, "temperature": 0, "max_tokens": 128}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    # Tests that need more than a 135M model can do. The grammar keeps every token valid JSON,
    # but greedy SmolLM2-135M may repeat itself inside the free-text "setup" string of the
    # suite's Joke schema ("sampu, sampu, ...") until max_tokens, so the object is cut before
    # "punchline"; whether it does depends on the CPU class's numerics (bf16 on AVX512-BF16/AMX,
    # float32 elsewhere). So these are non-strict xfails limited to the suite's assertion and
    # the parser's error on a cut object: the model may pass or fail the suite's check, but
    # any other exception (a crash, a 4xx/5xx) still fails the test.
    _LOOPS = ("SmolLM2-135M may loop inside the Joke's free-text 'setup' string until "
              "max_tokens, so the JSON is cut before 'punchline'")

    def _may_fail(reason: str):
        return pytest.mark.xfail(reason=reason, strict=False,
                                 raises=(AssertionError, OutputParserException))

    # The suite wants a method-level xfail with a reason on every override; a condition of
    # False satisfies it without applying, so each variant carries its own xfail.
    _PYDANTIC_LOOPS = pytest.param("pydantic", marks=_may_fail(_LOOPS + " (pydantic variant)"))

    @pytest.mark.xfail(False, reason="per variant: see the parametrize marks")
    @pytest.mark.parametrize("schema_type", [_PYDANTIC_LOOPS, "typeddict", "json_schema"])
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(False, reason="per variant: see the parametrize marks")
    @pytest.mark.parametrize("schema_type", [_PYDANTIC_LOOPS, "typeddict", "json_schema"])
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @_may_fail(_LOOPS)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @_may_fail(_LOOPS + " (json_mode with the Joke schema enforced)")
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @_may_fail("with tool_choice='auto' SmolLM2-135M may answer 'What is the weather in San "
               "Francisco?' in text instead of calling get_weather (forced calls are "
               "grammar-enforced and pass: test_tool_calling, tool_choice)")
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        llm = self.chat_model_class(**self.chat_model_params)
        messages = [("system", "You answer questions about the solar system. " * 20),
                    ("user", "How many planets are there?")]
        llm.invoke(messages)  # computes the prefix; the second call reads it from the cache
        if not stream:
            return llm.invoke(messages)
        total = None
        for chunk in llm.stream(messages):
            total = chunk if total is None else total + chunk
        return total


class Person(pydantic.BaseModel):
    name: str
    age: int = pydantic.Field(ge=0, le=150)


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def weather(city: str) -> str:
    """Current weather in a city."""
    return "sunny"


@pytest.fixture
def llm(default_server):
    return ChatSGLang(base_url=default_server.url, temperature=0, max_tokens=64)


@pytest.mark.default_model
@pytest.mark.slow
def test_structured_output_validates_24_of_24(llm):
    structured = llm.with_structured_output(Person)
    names = ["Ada", "Alan", "Grace", "Linus", "Barbara"]
    inputs = [f"{names[i % 5]} is {20 + i} years old. Describe the person." for i in range(24)]
    results = structured.batch(inputs, config={"max_concurrency": 8})
    assert len(results) == 24 and all(isinstance(r, Person) for r in results)


@pytest.mark.default_model
def test_structured_output_methods_and_include_raw(llm):
    schema = {"title": "City", "type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    for method in ("json_schema", "function_calling", "json_mode"):
        out = llm.with_structured_output(Person, method=method).invoke(
            "Grace Hopper was 85. Reply in JSON with name and age.")
        assert isinstance(out, Person)
    out = llm.with_structured_output(schema, include_raw=True).invoke("Paris is nice.")
    assert out["parsing_error"] is None and isinstance(out["parsed"]["city"], str)
    assert out["raw"].usage_metadata["input_tokens"] > 0


@pytest.mark.default_model
def test_json_mode_is_valid_json_and_enforces_a_given_schema(llm):
    """json_mode without a schema: always a JSON object; with one: that schema (prompts that
    do not ask for JSON, where a free-running 135M model writes prose)."""
    free = llm.with_structured_output(method="json_mode")
    for prompt in ("Tell me about Paris.", "Hello!", "Count to three."):
        assert isinstance(free.invoke(prompt), dict)
    class City(pydantic.BaseModel):  # bounded strings: the object completes within max_tokens
        name: str = pydantic.Field(max_length=16)
        population: int

    typed = llm.with_structured_output(City, method="json_mode")
    for prompt in ("Tell me about Paris.", "Hello!"):
        assert isinstance(typed.invoke(prompt), City)


@pytest.mark.default_model
def test_tool_choice_any_always_calls_with_valid_args(llm):
    bound = llm.bind_tools([add, weather], tool_choice="any")
    prompts = ["What is 2 plus 3?", "Is it raining in Oslo?", "Hello!", "Tell me a joke."]
    for msg in bound.batch(prompts):
        assert len(msg.tool_calls) >= 1
        call = msg.tool_calls[0]
        tool_ = {"add": add, "weather": weather}[call["name"]]
        tool_.args_schema.model_validate(call["args"])
    named = llm.bind_tools([add, weather], tool_choice="weather").invoke("2+2?")
    assert [c["name"] for c in named.tool_calls] == ["weather"]
    with pytest.raises(ValueError):
        llm.bind_tools([add], tool_choice="nope")


@pytest.mark.default_model
def test_batch_of_16_computes_the_shared_prefix_once(llm):
    system = "You are a meticulous assistant for a library catalogue. " * 12
    inputs = [[("system", system), ("user", f"Is book {i} on the shelf?")] for i in range(16)]
    sent = llm.hints.sent
    results = llm.batch(inputs, config={"max_concurrency": 8})
    assert llm.hints.sent == sent + 1
    cached = [r.usage_metadata["input_token_details"]["cache_read"] for r in results]
    prompt = min(r.usage_metadata["input_tokens"] for r in results)
    assert min(cached) > 0.8 * prompt  # every request, the first ones too, found it cached


@pytest.mark.default_model
def test_stream_marks_the_last_chunk_and_reports_usage(llm):
    chunks = list(llm.stream("Count to five."))
    assert chunks[-1].chunk_position == "last"
    total = chunks[0]
    for c in chunks[1:]:
        total += c
    assert total.content and total.usage_metadata["output_tokens"] > 0
    assert total.response_metadata["finish_reason"] in ("stop", "length")


def test_ls_params_honour_a_per_call_model():
    llm = ChatSGLang(temperature=0.5, max_tokens=10)
    params = llm._get_ls_params(model="other")
    assert params["ls_model_name"] == "other" and params["ls_provider"] == "sglang"
    assert params["ls_temperature"] == 0.5 and params["ls_max_tokens"] == 10


def test_default_requests_send_only_the_default_max_tokens():
    from sgl_adapters.langchain.chat_model import DEFAULT_MAX_TOKENS

    body = ChatSGLang()._request([], None, {})
    assert body == {"model": "default", "messages": [], "max_tokens": DEFAULT_MAX_TOKENS}


def test_every_request_carries_a_max_tokens():
    """Never "the rest of the context": the model's max_tokens (also under ChatOpenAI's alias
    max_completion_tokens), a per-call one, or DEFAULT_MAX_TOKENS (also for an explicit
    None)."""
    from sgl_adapters.langchain.chat_model import DEFAULT_MAX_TOKENS

    assert ChatSGLang(max_tokens=None)._request([], None, {})["max_tokens"] == DEFAULT_MAX_TOKENS
    assert ChatSGLang(max_completion_tokens=12)._request([], None, {})["max_tokens"] == 12
    llm = ChatSGLang(max_tokens=20)
    assert llm._request([], None, {})["max_tokens"] == 20
    assert llm._request([], None, {"max_tokens": 5})["max_tokens"] == 5
    assert llm._request([], None, {"max_completion_tokens": 6})["max_tokens"] == 6
    assert llm._get_ls_params()["ls_max_tokens"] == 20
    assert ChatSGLang()._get_ls_params()["ls_max_tokens"] == DEFAULT_MAX_TOKENS


def _params(fn) -> list[tuple[str, str, object]]:
    import inspect

    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_public_methods_take_chat_openai_arguments():
    """Every public method ChatSGLang shares with langchain_openai.ChatOpenAI takes the same
    parameters (names, kinds, defaults; annotations aside). The differences that remain are
    in the constructor fields, listed in docs/adapters.md's LangChain section."""
    langchain_openai = pytest.importorskip("langchain_openai")
    ours, theirs = ChatSGLang, langchain_openai.ChatOpenAI
    differ = {}
    for name in sorted(n for n in dir(ours) if not n.startswith("_") and hasattr(theirs, n)):
        a, b = getattr(ours, name), getattr(theirs, name)
        if callable(a) and callable(b) and not isinstance(a, type):
            try:
                pa, pb = _params(a), _params(b)
            except (TypeError, ValueError):  # builtins without a signature
                continue
            if pa != pb:
                differ[name] = (pa, pb)
    assert differ == {}


def test_json_mode_without_a_schema_and_its_errors():
    llm = ChatSGLang()
    runnable = llm.with_structured_output(method="json_mode")  # ChatOpenAI's call, schema=None
    assert runnable.first.kwargs["response_format"] == {"type": "json_object"}
    with pytest.raises(ValueError, match="needs a schema"):
        llm.with_structured_output()
    with pytest.raises(ValueError, match="strict"):
        llm.with_structured_output(method="json_mode", strict=True)


def test_program_runnable_puts_fork_and_select_in_a_chain(tiny_server):
    from langchain_core.runnables import RunnableLambda

    import sgl_adapters as sgl
    from sgl_adapters.langchain.program import ProgramRunnable

    @sgl.function
    def pick(s, question):
        s += sgl.user(question)
        forks = s.fork(3)
        for f in forks:
            f += sgl.assistant(sgl.gen("answer", max_tokens=4, ignore_eos=True))
        forks.join()
        s += sgl.user("Best?") + sgl.assistant(sgl.select("best", ["1", "2", "3"]))

    backend = sgl.RuntimeEndpoint(tiny_server.url)
    chain = RunnableLambda(lambda q: {"question": q.upper()}) | ProgramRunnable(
        pick, backend, outputs=["answer", "best"], temperature=0.8)
    out = chain.invoke("which?")
    assert len(out["answer"]) == 3 and out["best"] in ("1", "2", "3")
    outs = chain.batch(["a?", "b?"])
    assert all(o["best"] in ("1", "2", "3") for o in outs)
    bad = ProgramRunnable(pick, sgl.RuntimeEndpoint("http://127.0.0.1:9", timeout=2))
    with pytest.raises(sgl.ProgramError) as info:  # the fork meets the unreachable server
        bad.invoke({"question": "x"})
    assert isinstance(info.value.__cause__, sgl.BackendError)
