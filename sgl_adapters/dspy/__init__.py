"""DSPy adapter: ``dspy.configure(lm=SGLangLM())`` runs DSPy programs on the bundled server.

    import dspy
    from sgl_adapters.dspy import SGLangLM

    dspy.configure(lm=SGLangLM(base_url="http://127.0.0.1:30000"))
    classify = dspy.Predict("text -> sentiment: Literal['positive', 'negative']")
    classify(text="What a lovely day").sentiment   # always one of the two labels

``SGLangLM`` is a ``dspy.LM`` whose engine (DSPy 3.4's custom-engine contract) is
:class:`~sgl_adapters.dspy.engine.SGLangEngine`: ChatAdapter calls are lowered into programs of
the language (typed fields by constrained decoding, markers as constants; see
:mod:`~sgl_adapters.dspy.lowering`), other calls use the server's OpenAI route with grammar-
enforced ``response_format`` and tools. ``lowering=False`` gives plain ChatAdapter/JSONAdapter
behaviour against the server.

Grounded answers: ``answer: str = dspy.OutputField(desc=copied_from("context", "a short
phrase"))`` makes the lowered program copy ``answer`` verbatim from input field ``context``
(a word span of one passage, enforced by an EBNF grammar on the server).
"""

from __future__ import annotations

from typing import Any

import dspy

from sgl_adapters.dspy.engine import AsyncSGLangEngine, SGLangEngine
from sgl_adapters.dspy.lowering import copied_from


class SGLangLM(dspy.LM):
    """A ``dspy.LM`` for the bundled server.

    Args:
        model: the server's served model name ("default" for the embedded model).
        base_url: server root, e.g. ``http://127.0.0.1:30000`` (no ``/v1``).
        api_key: the server's ``--api-key``, if any (kept on the engine, never saved).
        temperature, max_tokens, cache, num_retries: as for ``dspy.LM``.
        lowering: lower ChatAdapter calls into gen/select programs (default True).
        timeout: seconds per HTTP request.
        **kwargs: default request fields (top_p, top_k, seed, stop, ...).
    """

    def __init__(self, model: str = "default", base_url: str = "http://127.0.0.1:30000",
                 api_key: str | None = None, temperature: float | None = None,
                 max_tokens: int | None = None, cache: bool = True, num_retries: int = 3,
                 lowering: bool = True, timeout: float = 600.0, **kwargs: Any):
        # dspy's load_state passes back the engines it restored from dump_state
        engine = kwargs.pop("engine", None) or SGLangEngine(
            base_url, api_key=api_key, model=model, lowering=lowering, timeout=timeout)
        async_engine = kwargs.pop("async_engine", None) or AsyncSGLangEngine(engine)
        super().__init__(model, engine=engine, async_engine=async_engine,
                         temperature=temperature, max_tokens=max_tokens, cache=cache,
                         num_retries=num_retries, **kwargs)

    @property
    def sglang_engine(self) -> SGLangEngine:
        return self.engine


__all__ = ["AsyncSGLangEngine", "SGLangEngine", "SGLangLM", "copied_from"]
