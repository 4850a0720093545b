"""A conversation rendered with the model's own chat template, for both front ends: the HTTP
process's tokenizer manager (which tokenizes the text and answers a refusal with a 400) and the
offline :class:`server.engine.Engine` (which returns the text). Torch-free.

The template is the tokenizer's (``tokenizer_config.json``'s ``chat_template``, or a GGUF's
``tokenizer.chat_template``), rendered by transformers' ``apply_chat_template`` with
``tokenize=False``, so the text is what HF would produce; ``tools`` is passed only when given
and ``template_kwargs`` become template variables (e.g. Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

# template variables a request may not override (they are the call's own arguments)
RESERVED_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "tools", "messages")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; ``param`` names the request field to blame
    ("messages" or "chat_template_kwargs")."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                add_generation_prompt: bool = True, tools: list[dict] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The text of ``messages`` (OpenAI-style dicts) under ``tokenizer``'s chat template,
    ending with the assistant's turn opened when ``add_generation_prompt``.

    Raises ChatTemplateError: a reserved name in ``template_kwargs``, or a template that
    rejects the conversation (e.g. roles out of order)."""
    extra = dict(template_kwargs or {})
    for name in RESERVED_KWARGS:
        if name in extra:
            raise ChatTemplateError("chat_template_kwargs",
                                    f"chat_template_kwargs may not set {name!r}")
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}), **extra)
    except Exception as exc:  # noqa: BLE001 - a template's own error (jinja raises anything)
        raise ChatTemplateError("messages", "the chat template rejected these messages: "
                                f"{exc}") from exc
