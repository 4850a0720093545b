"""The language without a server: IR, chat-template role markers, choice scoring, API
speculation matching, the tracer, and the interpreter against an in-memory backend."""

from __future__ import annotations

import threading

import pytest

import sgl_adapters as sgl
from sgl_adapters.backends.base import BackendError, GenCall, GenResult, SelectResult
from sgl_adapters.lang import ir
from sgl_adapters.lang.chat_template import ChatTemplate
from sgl_adapters.lang.choices import choice_token_count, choose
from sgl_adapters.lang.speculative import consume_text, take_gen

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


class EchoBackend:
    """Deterministic in-memory backend: gen returns a fixed reply, select the longest choice."""

    is_chat_model = False

    def __init__(self, reply: str = "ok", fail_after: int | None = None):
        self.reply, self.fail_after = reply, fail_after
        self.calls: list[GenCall] = []
        self.hints: list[str] = []
        self.lock = threading.Lock()

    @property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_jinja(SMOLLM2_TEMPLATE)

    def generate(self, call: GenCall) -> GenResult:
        with self.lock:
            self.calls.append(call)
            if self.fail_after is not None and len(self.calls) > self.fail_after:
                raise BackendError("server down")
        return GenResult(self.reply, {"completion_tokens": 1})

    def generate_stream(self, call: GenCall):
        result = self.generate(call)
        for ch in result.text:
            yield ch
        yield result

    def select(self, call, choices, method, temperature=0.0):
        return SelectResult(max(choices, key=len), {"normalized_prompt_logprobs": [0.0] * len(choices)})

    def cache_prefix(self, text: str) -> None:
        self.hints.append(text)

    def shutdown(self) -> None:
        pass


# -- IR -----------------------------------------------------------------------------------------
def test_sampling_args_merge_and_native_fields():
    g = sgl.gen("x", max_tokens=8, stop=["\n", "."], regex=None)
    merged = g.sampling.merged(ir.SamplingArgs(max_tokens=99, temperature=0.0))
    assert merged.max_tokens == 8 and merged.temperature == 0.0
    assert merged.native() == {"max_new_tokens": 8, "stop": ["\n", "."], "temperature": 0.0}
    assert ir.SamplingArgs().native() == {}  # nothing set: nothing sent


def test_gen_dtypes_and_bad_arguments():
    assert sgl.gen("n", dtype=int).sampling.regex == ir.DTYPE_REGEX[int]
    b = sgl.gen("b", dtype=bool)
    assert isinstance(b, ir.Select) and b.choices == ("True", "False") and b.dtype is bool
    assert isinstance(sgl.gen("c", choices=["a", "b"]), ir.Select)
    assert ir.convert(" 42", int) == 42 and ir.convert("-1.5", float) == -1.5
    with pytest.raises(ValueError):
        sgl.gen("x", regex="a", json_schema={})
    with pytest.raises(ValueError):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError):
        sgl.select("x", [])
    with pytest.raises(ValueError):
        sgl.select("x", ["a", "a"])
    with pytest.raises(TypeError):
        ir.to_expr(3)


def test_concat_flattens_in_order():
    e = "Q: " + sgl.gen("a") + "\n" + sgl.select("b", ["x", "y"])
    kinds = [type(x).__name__ for x in ir.flatten(e)]
    assert kinds == ["Text", "Gen", "Text", "Select"]


# -- chat template ------------------------------------------------------------------------------
def test_chat_template_roles_match_apply_chat_template(default_tokenizer):
    t = ChatTemplate.from_jinja(default_tokenizer.chat_template)
    assert t.roles["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.default_system.startswith("<|im_start|>system\nYou are a helpful AI")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    text = t.render([(m["role"], m["content"]) for m in msgs])
    assert text == default_tokenizer.apply_chat_template(msgs, tokenize=False)
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    assert t.render([(m["role"], m["content"]) for m in with_system]) == \
        default_tokenizer.apply_chat_template(with_system, tokenize=False)


def test_chat_template_falls_back_to_plain():
    assert ChatTemplate.from_jinja(None) == ChatTemplate.plain()
    broken = "{{ raise_exception('no system role') }}"
    assert ChatTemplate.from_jinja(broken) == ChatTemplate.plain()


# -- choices and speculation --------------------------------------------------------------------
def test_choice_methods():
    lps = [[-1.0, -1.0], [-0.5, -3.0], [-1.2]]
    assert choose("token_length_normalized", lps)[0] == 0  # means -1, -1.75, -1.2
    assert choose("greedy", lps)[0] == 1  # -0.5 wins at the first token
    idx, scores = choose("unconditional_likelihood_normalized", lps, [[-5.0, -5.0], [-1, -1], [-1]])
    assert idx == 0 and scores[0] == pytest.approx(4.0)
    with pytest.raises(ValueError):
        choose("nope", lps)


def test_choice_token_count_includes_the_boundary_token():
    # prompt "Answer:" + choice " yes" tokenized as ["Answer", ":", " yes"]
    assert choice_token_count(["Answer", ":", " yes"], " yes") == 1
    # a merge across the boundary: "A" + "BC" -> ["xA", "B", "C"]... "AB" straddles
    assert choice_token_count(["x", "AB", "C"], "BC") == 2
    assert choice_token_count(["x"], "") == 1


def test_speculation_matching():
    assert take_gen("Alice\nAge: 30\n", ("\n",)) == ("Alice", "\nAge: 30\n")
    assert take_gen("Alice", ("\n",)) is None
    assert take_gen("Alice", ("\n",), ended=True) == ("Alice", "")  # the model stopped there
    assert consume_text("\nAge: 30\n", "\nAge: ") == "30\n"
    assert consume_text("\nAge: 30\n", "\nCity: ") == ""  # mismatch drops the buffer
    assert consume_text("\nAg", "\nAge: ") == ""


# -- tracer -------------------------------------------------------------------------------------
@sgl.function
def essay_judge_like(s, essay):
    s += sgl.system("You judge essays.")
    with s.user():
        s += "Essay: " + essay + "\nIs it on topic?"
    s += sgl.assistant(sgl.select("relevant", ["yes", "no"]))
    forks = s.fork(3)
    for f, aspect in zip(forks, ["clarity", "originality", "evidence"]):
        f += sgl.user(f"Judge the {aspect}.") + sgl.assistant(sgl.gen("judgment", max_tokens=32))
    forks.join()
    s += sgl.user("Summarize: " + s["judgment"][0] + s["judgment"][1] + s["judgment"][2])
    s += sgl.assistant(sgl.gen("summary", max_tokens=64) + "\nGrade: " + sgl.gen("grade", regex="[A-F]"))


@sgl.function
def skeleton_of_thought(s, question):
    s += "Question: " + question + "\nSkeleton (3 points):\n"
    for i in range(3):
        s += f"{i + 1}. " + sgl.gen(f"point{i}", stop="\n") + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Expand point {i + 1}: " + sgl.gen("expansion", max_tokens=64)
    forks.join()
    s += "Answer: " + sgl.gen("answer", max_tokens=128)


def test_trace_essay_judge():
    t = essay_judge_like.trace()
    assert len(t.streams) == 4 and t.parents == {1: 0, 2: 0, 3: 0}
    main = [n.kind for n in t.streams[0]]
    assert main[:8] == ["role_begin", "text", "role_end", "role_begin", "text", "arg", "text",
                        "role_end"]
    assert "fork" in main and "join" in main
    assert [n.label for n in t.nodes("gen")] == ["summary", "grade"] + ["judgment"] * 3
    summary_vars = [n for n in t.streams[0] if n.kind == "var"]
    assert [d for n in summary_vars for d in n.deps] == [(1, "judgment"), (2, "judgment"),
                                                         (3, "judgment")]
    text = str(t)
    assert "select     relevant choices=['yes', 'no']" in text and "stream 3 (forked" in text
    template = ChatTemplate.from_jinja(SMOLLM2_TEMPLATE)
    assert t.constant_prefix(template) == (
        "<|im_start|>system\nYou judge essays.<|im_end|>\n<|im_start|>user\nEssay: ")


def test_trace_skeleton_of_thought_with_given_argument():
    t = skeleton_of_thought.trace(question="Why is the sky blue?")
    assert [n.label for n in t.nodes("gen")] == ["point0", "point1", "point2", "answer"] + [
        "expansion"] * 3
    assert t.constant_prefix(ChatTemplate.plain()) == (
        "Question: Why is the sky blue?\nSkeleton (3 points):\n1. ")
    assert "fork       3 -> streams 1, 2, 3" in str(t)


def test_data_dependent_programs_are_not_traceable():
    @sgl.function
    def branchy(s, q):
        s += q + sgl.gen("a", max_tokens=4)
        if s["a"] == "yes":
            s += "more"

    @sgl.function
    def loops_over_argument(s, items):
        for item in items:
            s += item

    @sgl.function
    def string_method(s, q):
        s += q.strip()

    for fn in (branchy, loops_over_argument, string_method):
        with pytest.raises(sgl.NotTraceable):
            fn.trace()


# -- interpreter on the in-memory backend -------------------------------------------------------
def test_roles_messages_and_text():
    @sgl.function
    def chat(s, q):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("a"))

    s = chat.run("hi", backend=EchoBackend("hello"))
    assert s["a"] == "hello"
    assert s.messages() == [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"}]
    assert s.text().endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello"
                             "<|im_end|>\n")


def test_fork_join_hint_and_gather():
    backend = EchoBackend("v")
    s = skeleton_of_thought.run(question="q", backend=backend)
    assert s["expansion"] == ["v", "v", "v"]
    assert backend.hints and backend.hints[0].endswith("3. v\n")
    branch_prompts = [c.text for c in backend.calls if c.text.endswith("Expand point 2: ")]
    assert len(branch_prompts) == 1


def test_errors_surface_on_the_state_and_never_hang():
    @sgl.function
    def two(s):
        s += "a" + sgl.gen("x") + sgl.gen("y")

    s = two.run(backend=EchoBackend(fail_after=1))
    assert isinstance(s.error(), BackendError)
    assert s["x"] == "ok"
    with pytest.raises(sgl.ProgramError):
        s["y"]
    with pytest.raises(KeyError):
        two.run(backend=EchoBackend())["never"]


def test_run_batch_hints_once_and_keeps_failures_on_states():
    @sgl.function
    def prog(s, q):
        s += "Shared instructions. " + q
        if q == "boom":
            raise ValueError("boom")
        s += sgl.gen("a")

    backend = EchoBackend()
    states = prog.run_batch([{"q": "x"}, {"q": "boom"}, {"q": "y"}], progress_bar=False,
                            backend=backend)
    assert backend.hints == []  # data-dependent: not traceable, so no hint
    assert states[0]["a"] == "ok" and isinstance(states[1].error(), ValueError)

    @sgl.function
    def plain(s, q):
        s += "Shared instructions. " + q + sgl.gen("a")

    plain.run_batch([{"q": "x"}, {"q": "y"}], progress_bar=False, backend=backend)
    assert backend.hints == ["Shared instructions. "]


def test_streaming_text_iter():
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")

    s = prog.run(stream=True, backend=EchoBackend("abc"))
    assert "".join(s.text_iter("a")) == "abc"
    assert "".join(s.text_iter()) == "xabc"


def test_api_speculation_in_the_interpreter():
    @sgl.function(num_api_spec_tokens=32)
    def extract(s):
        s += "Name: " + sgl.gen("name", stop="\n") + "\nAge: " + sgl.gen("age", stop="\n")

    backend = EchoBackend("Bob\nAge: 41\nCity: X")
    s = extract.run(backend=backend)
    assert (s["name"], s["age"]) == ("Bob", "41") and len(backend.calls) == 1
    assert backend.calls[0].sampling.stop is None and backend.calls[0].sampling.max_tokens == 32
    backend = EchoBackend("Bob\nHeight: 2")  # the model left the template: fall back
    s = extract.run(backend=backend)
    assert s["name"] == "Bob" and len(backend.calls) == 2


def test_each_call_carries_how_many_calls_its_program_made_before():
    """GenCall.priority counts a program's earlier gen/select calls (forks continue their
    parent's count, and the parent continues after theirs), so a server scheduling by
    priority admits a program's later calls before new programs' first ones."""
    backend = EchoBackend()

    @sgl.function
    def program(s):
        s += "Q:" + sgl.gen("a", max_tokens=2)
        s += sgl.gen("b", max_tokens=2)
        forks = s.fork(2)
        for f in forks:
            f += sgl.gen("c", max_tokens=2)
        forks.join()
        s += sgl.gen("d", max_tokens=2)

    program.run(backend=backend)
    assert sorted(c.priority for c in backend.calls) == [0, 1, 2, 2, 3]
    assert backend.calls[0].priority == 0 and backend.calls[-1].priority == 3
