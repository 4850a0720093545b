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
from sgl_adapters.dspy.openai_target import AsyncOpenAITargetEngine, OpenAITargetEngine


class SGLangLM(dspy.LM):
    """A ``dspy.LM`` for the bundled server.

    Args:
        model: the server's served model name ("default" for the embedded model), or a LoRA
            adapter it serves ("NAME" or "BASE:NAME"): every call of this LM runs on it.
        base_url: server root, e.g. ``http://127.0.0.1:30000`` (no ``/v1``).
        api_key: the server's ``--api-key``, if any (kept on the engine, never saved).
        temperature, max_tokens, cache, num_retries: as for ``dspy.LM``.
        lowering: lower ChatAdapter calls into gen/select programs (default True).
        timeout: seconds per HTTP request.
        backend: "sglang" (the bundled server; ``base_url`` is its root) or "openai" (any
            OpenAI-compatible endpoint; ``base_url`` ends in ``/v1``): ChatAdapter calls are
            answered by one call holding every output field, checked field by field, with one
            retry (:mod:`~sgl_adapters.dspy.openai_target`).
        structured_outputs: with backend "openai", whether the endpoint honours
            ``response_format`` json_schema (OpenAI, vLLM, llama.cpp, ours do).
        **kwargs: default request fields (top_p, top_k, seed, stop, ...).
    """

    def __init__(self, model: str = "default", base_url: str = "http://127.0.0.1:30000",
                 api_key: str | None = None, temperature: float | None = None,
                 max_tokens: int | None = None, cache: bool = True, num_retries: int = 3,
                 lowering: bool = True, timeout: float = 600.0, backend: str = "sglang",
                 structured_outputs: bool = True, **kwargs: Any):
        # dspy's load_state passes back the engines it restored from dump_state
        engine = kwargs.pop("engine", None)
        async_engine = kwargs.pop("async_engine", None)
        if engine is None and backend == "openai":
            engine = OpenAITargetEngine(base_url, model=model, api_key=api_key,
                                        structured_outputs=structured_outputs,
                                        timeout=timeout)
        elif engine is None and backend == "sglang":
            engine = SGLangEngine(base_url, api_key=api_key, model=model, lowering=lowering,
                                  timeout=timeout)
        elif engine is None:
            raise ValueError(f"backend must be 'sglang' or 'openai', got {backend!r}")
        if async_engine is None:
            async_engine = (AsyncOpenAITargetEngine(engine)
                            if isinstance(engine, OpenAITargetEngine)
                            else AsyncSGLangEngine(engine))
        super().__init__(model, engine=engine, async_engine=async_engine,
                         temperature=temperature, max_tokens=max_tokens, cache=cache,
                         num_retries=num_retries, **kwargs)

    @property
    def sglang_engine(self) -> SGLangEngine:
        """The engine behind this LM (its backend, prefix hints and lowering switch)."""
        return self.engine


__all__ = ["AsyncOpenAITargetEngine", "AsyncSGLangEngine", "OpenAITargetEngine",
           "SGLangEngine", "SGLangLM", "copied_from"]
