"""The three RAG pipelines, each answering a batch of questions through the bundled server.

Each takes (questions, retriever, k, base_url) and returns one answer per question: its text,
or the exception that question ended with (a parse failure, a refused request), so one bad
answer never costs the others theirs.
With ``grounded`` a span answer is constrained to a contiguous word span (at most MAX_WORDS
words) of one retrieved passage (grounded extraction: ``substring_of`` in the language,
``copied_from`` in DSPy, ``bind(substring_of=...)`` in LangChain); without, it is free text.
On the 135M default model grounding lowers span F1 (it picks sentence openings; see
docs/adapters.md), so the main job leaves it off unless asked.
* ``sgl``: the native language. All k passages and the question form one prompt; the state
  forks k ways (the prompt is prefilled once and shared), each branch notes what its passage
  says, and the parent merges the notes and answers (``select`` yes/no, or a short ``gen``).
* ``dspy``: ``dspy.configure(lm=SGLangLM(...))``; ChainOfThought over a signature with the
  retrieved context; yes/no questions use a ``Literal['yes', 'no']`` output, which the
  adapter lowers to ``select``.
* ``langchain``: retriever | prompt | ``ChatSGLang.with_structured_output`` (a schema with
  the answer; a ``Literal`` enum for yes/no questions).
"""

from __future__ import annotations

from typing import Literal

from examples.rag.data import Question
from examples.rag.retrieval import Retriever

MAX_WORDS = 6  # grounded span answers: SQuAD answers are a few words long
SYSTEM = ("You answer questions using Wikipedia passages. Give the shortest answer that is "
          "correct: a short phrase copied from the passages, or yes/no.")


def _passages_text(passages) -> str:
    return "\n\n".join(f"[{i + 1}] {p.text}" for i, p in enumerate(passages))


Answer = str | Exception


def run_sgl(questions: list[Question], retriever: Retriever, k: int, base_url: str,
            threads: int = 16, progress: bool = False, grounded: bool = True) -> list[Answer]:
    import sgl_adapters as sgl

    @sgl.function
    def rag(s, question: str, passages: str, texts: list[str], k: int, yes_no: bool):
        s += sgl.system(SYSTEM)
        with s.user():
            s += f"Passages:\n{passages}\n\nQuestion: {question}"
        notes = s.fork(k)
        for i, f in enumerate(notes):
            f += sgl.assistant(f"Passage [{i + 1}] says: " + sgl.gen("note", max_tokens=24,
                                                                      stop="\n"))
        notes.join()
        s += sgl.assistant("Notes:\n" + "\n".join(f"- {n}" for n in s["note"]))
        if yes_no:
            s += sgl.user("Answer yes or no.")
            s += sgl.assistant(sgl.select("answer", ["yes", "no"]))
        else:
            s += sgl.user("Answer with a short phrase from the passages.")
            s += sgl.assistant(sgl.gen("answer", max_tokens=16, stop=["\n", "."],
                                       substring_of=texts if grounded else None,
                                       max_words=MAX_WORDS))

    backend = sgl.RuntimeEndpoint(base_url)
    args = []
    for q in questions:
        passages = retriever.search(q.question, k)
        args.append({"question": q.question, "passages": _passages_text(passages),
                     "texts": [p.text for p in passages], "k": k,
                     "yes_no": q.answer_type == "yes_no"})
    states = rag.run_batch(args, num_threads=threads, progress_bar=progress, backend=backend,
                           temperature=0)
    backend.shutdown()
    return [s["answer"].strip() if s.error() is None else s.error() for s in states]


def run_dspy(questions: list[Question], retriever: Retriever, k: int, base_url: str,
             threads: int = 16, progress: bool = False, lm=None, grounded: bool = True
             ) -> list[Answer]:
    """``lm``: another dspy.LM to run the same program on (the OpenAI-route baseline);
    default SGLangLM on ``base_url``."""
    import dspy

    from sgl_adapters.dspy import SGLangLM, copied_from

    class SpanQA(dspy.Signature):
        """Answer the question with a short phrase copied from the context."""

        context: list[str] = dspy.InputField()
        question: str = dspy.InputField()
        answer: str = dspy.OutputField(desc=copied_from("context", "a short phrase", MAX_WORDS)
                                       if grounded else "a short phrase")

    class YesNoQA(dspy.Signature):
        """Answer the yes/no question using the context."""

        context: list[str] = dspy.InputField()
        question: str = dspy.InputField()
        answer: Literal["yes", "no"] = dspy.OutputField()

    class RAG(dspy.Module):
        def __init__(self):
            super().__init__()
            self.span, self.yes_no = dspy.ChainOfThought(SpanQA), dspy.ChainOfThought(YesNoQA)

        def forward(self, question: str, yes_no: bool):
            context = [p.text for p in retriever.search(question, k)]
            try:
                return (self.yes_no if yes_no else self.span)(context=context, question=question)
            except Exception as exc:  # noqa: BLE001 - counted per question, never fatal
                # (raised, it would count towards dspy's max_errors, and reaching that cancels
                # the whole batch: a model whose every answer fails to parse lost the table)
                return dspy.Prediction(answer=None, error=exc)

    lm = lm or SGLangLM(base_url=base_url, temperature=0.0, max_tokens=48, cache=False)
    examples = [dspy.Example(question=q.question, yes_no=q.answer_type == "yes_no")
                .with_inputs("question", "yes_no") for q in questions]
    with dspy.context(lm=lm, adapter=None):
        preds = RAG().batch(examples, num_threads=threads, max_errors=len(examples),
                            provide_traceback=False, disable_progress_bar=not progress)
    return [p.error if p.get("error") is not None else str(p.answer or "").strip()
            for p in preds]


def run_langchain(questions: list[Question], retriever: Retriever, k: int, base_url: str,
                  threads: int = 16, progress: bool = False, grounded: bool = True, llm=None
                  ) -> list[Answer]:
    """``llm``: another chat model to run the same chain on (a stock ``ChatOpenAI``: its
    ``with_structured_output(method="json_schema")``; ``grounded`` needs ChatSGLang's
    ``substring_of``); default ChatSGLang on ``base_url``."""
    import pydantic
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda

    from sgl_adapters.langchain import ChatSGLang

    class SpanAnswer(pydantic.BaseModel):
        answer: str = pydantic.Field(max_length=60, description="a short phrase")

    class YesNoAnswer(pydantic.BaseModel):
        answer: Literal["yes", "no"]

    if llm is None:
        llm = ChatSGLang(base_url=base_url, temperature=0, max_tokens=48)
    elif grounded:
        raise ValueError("grounded span answers need ChatSGLang (substring_of)")
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), ("human", "Passages:\n{passages}\n\nQuestion: {question}")])
    def retrieve(x: dict) -> dict:
        passages = retriever.search(x["question"], k)
        return {"question": x["question"], "passages": _passages_text(passages),
                "texts": [p.text for p in passages]}

    def grounded_answer(x: dict) -> SpanAnswer:  # the answer is a span of these passages
        text = (prompt | llm.bind(substring_of=x["texts"], max_words=MAX_WORDS)
                | StrOutputParser()).invoke(x)
        return SpanAnswer(answer=text[:60])

    span = RunnableLambda(grounded_answer) if grounded else prompt | llm.with_structured_output(
        SpanAnswer, method="json_schema")
    chains = {False: RunnableLambda(retrieve) | span,
              True: RunnableLambda(retrieve) | prompt | llm.with_structured_output(
                  YesNoAnswer, method="json_schema")}
    answers: list[Answer] = [""] * len(questions)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(questions), desc="langchain")
    for yes_no, chain in chains.items():
        idx = [i for i, q in enumerate(questions) if (q.answer_type == "yes_no") == yes_no]
        outs = chain.batch([{"question": questions[i].question} for i in idx],
                           config={"max_concurrency": threads}, return_exceptions=True)
        for i, out in zip(idx, outs):
            answers[i] = out if isinstance(out, Exception) else out.answer.strip()
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    return answers


PIPELINES = {"sgl": run_sgl, "dspy": run_dspy, "langchain": run_langchain}
