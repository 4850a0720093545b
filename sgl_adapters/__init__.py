"""sgl_adapters: a Python-embedded language for LM programs and its backends.

    import sgl_adapters as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is RadixAttention?")["answer"])

Primitives (SGLang paper §2): ``gen``, ``select``, ``system``/``user``/``assistant``, ``image``,
``s.fork(n)`` / ``forks.join()``; programs run with ``run``, ``run_batch``, stream with
``text_iter`` and trace with ``trace``. Backends: :class:`RuntimeEndpoint` (the bundled server),
:class:`Runtime` (starts it), :class:`OpenAI` (any OpenAI-compatible endpoint). The DSPy and
LangChain adapters live in ``sgl_adapters.dspy`` and ``sgl_adapters.langchain``.
"""

from sgl_adapters.backends.base import BackendError
from sgl_adapters.backends.openai import OpenAI
from sgl_adapters.backends.runtime import Runtime
from sgl_adapters.backends.runtime_endpoint import RuntimeEndpoint
from sgl_adapters.lang.function import SglFunction, function, set_default_backend
from sgl_adapters.lang.interpreter import ProgramError, ProgramState, ProgramStateGroup
from sgl_adapters.lang.ir import SamplingArgs, assistant, gen, image, select, system, user
from sgl_adapters.lang.tracer import NotTraceable, TracedProgram

__all__ = [
    "BackendError", "NotTraceable", "OpenAI", "ProgramError", "ProgramState", "ProgramStateGroup",
    "Runtime", "RuntimeEndpoint", "SamplingArgs", "SglFunction", "TracedProgram", "assistant",
    "function", "gen", "image", "select", "set_default_backend", "system", "user",
]
