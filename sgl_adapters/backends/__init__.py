"""Backends of the language: the Backend protocol (base), the bundled server over its native API
(runtime_endpoint), launching it (runtime), and any OpenAI-compatible endpoint (openai)."""
