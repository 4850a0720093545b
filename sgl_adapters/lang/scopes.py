"""What a program state and a tracing state share: role scopes (``with s.user(): ...``) and the
group of states ``fork`` returns. Subclasses say how an expression is appended (``_submit``)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from sgl_adapters.lang import ir


class RoleScopes:
    """``with s.system()/s.user()/s.assistant(): s += ...`` wraps the appended expressions in
    the model's role markers."""

    def _submit(self, expr: ir.Expr) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def _role(self, role: str):
        self._submit(ir.RoleBegin(role))
        yield self
        self._submit(ir.RoleEnd(role))

    def system(self):
        """``with s.system(): ...``: what is appended inside is a system turn."""
        return self._role("system")

    def user(self):
        """``with s.user(): ...``: what is appended inside is a user turn."""
        return self._role("user")

    def assistant(self):
        """``with s.assistant(): ...``: what is appended inside is an assistant turn."""
        return self._role("assistant")


class StateGroup:
    """The states made by ``fork``: indexable and iterable; ``forks += expr`` appends to each."""

    def __init__(self, parent: Any, states: list[Any]):
        self.parent, self.states = parent, states

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> Any:
        return self.states[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> StateGroup:
        for s in self.states:
            s += other
        return self
