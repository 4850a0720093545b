"""Role prefixes and suffixes from the model's own chat template.

The server reports its model's Jinja chat template (``GET /get_model_info`` -> ``chat_template``).
:func:`ChatTemplate.from_jinja` renders it (in Jinja's sandbox, as transformers does) on short
conversations whose contents are sentinels and cuts the output at the sentinels, so
``with s.user(): ...`` produces exactly the text ``apply_chat_template`` would: a program's
prompt and the server's ``/v1/chat/completions`` prompt share their prefix in the cache.
Templates that insert a default system turn when a conversation starts with the user (SmolLM2
does) keep doing so through :attr:`ChatTemplate.default_system`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

_SENTINEL = "\x1eSGL{}\x1e"


@dataclass(frozen=True)
class ChatTemplate:
    """Text around each role's content. ``roles[role] = (prefix, suffix)``; ``default_system``
    is the turn the template inserts before a first user turn ("" if none)."""

    roles: dict[str, tuple[str, str]]
    default_system: str = ""

    def prefix(self, role: str) -> str:
        """The text that opens a ``role`` turn. Raises KeyError for an unknown role."""
        return self.roles[role][0]

    def suffix(self, role: str) -> str:
        """The text that closes a ``role`` turn. Raises KeyError for an unknown role."""
        return self.roles[role][1]

    def turn(self, role: str, content: str) -> str:
        """One role turn as text. Raises KeyError for a role the template does not have."""
        return self.roles[role][0] + content + self.roles[role][1]

    def render(self, turns: Sequence[tuple[str, str]]) -> str:
        """``(role, content)`` turns as the template renders them without a generation prompt,
        including the default system turn when the conversation does not start with one.
        Raises KeyError for an unknown role."""
        head = self.default_system if turns and turns[0][0] != "system" else ""
        return head + "".join(self.turn(r, c) for r, c in turns)

    @classmethod
    def plain(cls) -> ChatTemplate:
        """For models without a template: ``Role: content`` lines."""
        return cls({r: (f"{r.capitalize()}: ", "\n") for r in ("system", "user", "assistant")})

    @classmethod
    def from_jinja(cls, template: str | None, bos_token: str = "",
                   eos_token: str = "") -> ChatTemplate:
        """Derive role markers from a Hugging Face chat template. Falls back to :meth:`plain`
        when there is no template or it cannot render a system/user/assistant conversation.
        ``bos_token`` is "" by default because the server's tokenizer adds it when encoding."""
        if not template:
            return cls.plain()
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        compiled = env.from_string(template)

        def render(turns: list[tuple[str, str]]) -> str:
            return compiled.render(messages=[{"role": r, "content": c} for r, c in turns],
                                   add_generation_prompt=False, bos_token=bos_token,
                                   eos_token=eos_token)

        s, u, a = (_SENTINEL.format(i) for i in range(3))
        try:
            with_system = render([("system", s)])
            with_user = render([("system", s), ("user", u)])
            full = render([("system", s), ("user", u), ("assistant", a)])
            user_only = render([("user", u)])
        except Exception:  # noqa: BLE001 - any template failure means "use plain roles"
            return cls.plain()
        if not (full.startswith(with_user) and with_user.startswith(with_system)):
            return cls.plain()
        system_block = with_system
        user_block = with_user[len(with_system):]
        assistant_block = full[len(with_user):]
        roles = {}
        for role, block, mark in (("system", system_block, s), ("user", user_block, u),
                                  ("assistant", assistant_block, a)):
            if block.count(mark) != 1:
                return cls.plain()
            before, after = block.split(mark)
            roles[role] = (before, after)
        # Whatever the template put before the user turn when no system turn was given.
        user_turn = roles["user"][0] + u + roles["user"][1]
        default_system = user_only[:user_only.index(user_turn)] if user_turn in user_only else ""
        return cls(roles, default_system)
