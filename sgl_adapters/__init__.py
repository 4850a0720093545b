"""sgl_adapters: a Python-embedded language for LM programs (gen, select, fork, join, roles,
run_batch, streaming, tracing) and its backends. The language arrives with issue [5/9]; the DSPy
and LangChain adapters live in ``sgl_adapters.dspy`` and ``sgl_adapters.langchain`` ([6/9],
[7/9])."""
