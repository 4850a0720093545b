"""Programs of the language as LangChain runnables, for chains that want fork/select inside.

    @sgl.function
    def judge(s, context, question):
        s += sgl.user(context + "\\n" + question)
        forks = s.fork(3)                                  # 3 answers sharing the prompt's KV
        for f in forks:
            f += sgl.assistant(sgl.gen("answer", max_tokens=64, temperature=0.7))
        forks.join()
        s += sgl.user("Which answer is best?") + sgl.assistant(sgl.select("best", ["1", "2", "3"]))

    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} \\
        | ProgramRunnable(judge, backend=sgl.RuntimeEndpoint(url))
    chain.invoke("...")   # {"answer": [...], "best": "2"}

Where it pays: a step that samples several candidates from one prompt (fork: the prompt is
prefilled once and shared, where n separate chat calls each resend it), picks among fixed
labels (select: one prefill-only scoring pass, no decoding), or interleaves several generations
in one growing prompt (each gen reuses the cached prefix). A single chat call gains nothing
over :class:`~sgl_adapters.langchain.ChatSGLang`.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import ConfigDict

from sgl_adapters.backends.base import Backend
from sgl_adapters.lang.function import SglFunction


class ProgramRunnable(RunnableSerializable[dict, dict]):
    """Runs ``program`` with the input dict as its arguments; returns its variables (all, or
    those named in ``outputs``). ``batch`` uses ``run_batch`` (shared prefix sent once).
    Raises the program's error (``ProgramError``/``BackendError``) like any runnable."""

    program: Any
    backend: Any
    outputs: list[str] | None = None
    sampling: dict[str, Any] = {}

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def __init__(self, program: SglFunction, backend: Backend, outputs: list[str] | None = None,
                 **sampling: Any):
        super().__init__(program=program, backend=backend, outputs=outputs, sampling=sampling)

    def _result(self, state) -> dict:
        error = state.error()
        if error is not None:
            raise error
        values = state.variables()
        return values if self.outputs is None else {k: values[k] for k in self.outputs}

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> dict:
        """Run the program on ``input`` (its arguments); its variables (``outputs`` of them
        when given). Raises the program's error."""
        return self._call_with_config(
            lambda x: self._result(self.program.run(backend=self.backend, **self.sampling, **x)),
            input, config)

    def batch(self, inputs: list[dict], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """Run the program on every input with ``run_batch`` (a shared prefix sent once)."""
        states = self.program.run_batch(list(inputs), progress_bar=False, backend=self.backend,
                                        **self.sampling)
        out = []
        for state in states:
            try:
                out.append(self._result(state))
            except Exception as exc:
                if not return_exceptions:
                    raise
                out.append(exc)
        return out
