"""DSPy adapter: ``SGLangLM`` and the lowering of DSPy signatures into gen/select programs
(issue [6/9])."""
