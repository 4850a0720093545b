"""The language: expressions (ir), chat-template role markers, the interpreter (one stream per
state), choice scoring, API speculation matching, the tracer, and ``@function``."""
