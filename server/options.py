"""Server options declared once: a config dataclass field (:mod:`server.config`) carries its
command-line flag, help text and polarity in its metadata (:func:`option`), and the CLI
(``server/__main__.py``), the replicas' command lines (``server/router/dp.py``) and the tests
are generated from those declarations (:func:`declared_options`), as vLLM's ``EngineArgs``
does. Torch-free: ``python -m server --help`` and the HTTP process read it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted values
    (re-exported by :mod:`server.config`)."""


class _Unset:
    """Flag.cli_default when the CLI's default is the field's own."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


@dataclass(frozen=True)
class Flag:
    """How one config field appears on ``python -m server``'s command line.

    Attributes:
        name: the flag, e.g. "--chunked-prefill-size"; ``aliases`` are accepted too.
        help: the text ``--help`` shows.
        choices: the accepted values, where argparse should check them.
        type: the value's parser; None = the type of the field's default (str when None).
        invert: a "--disable-x" flag that turns a field defaulting to True off.
        cli_default: the CLI's default where it differs from the library's (the offline
            ``Engine`` and the server have different needs); UNSET = the field's default.
        replica: passed on to the replicas of ``--dp-size`` (False: the front's own flag).
        nargs: argparse's, for a flag taking several values (a tuple field).
    """

    name: str
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None
    invert: bool = False
    cli_default: Any = UNSET
    replica: bool = True
    nargs: str | None = None

    @property
    def takes_value(self) -> bool:
        """False for a bare (boolean) flag."""
        return self.type is not bool

    def default(self, field_default: Any) -> Any:
        """The CLI's default for a field whose own default is ``field_default``."""
        return field_default if self.cli_default is UNSET else self.cli_default


def option(default: Any, name: str, help: str, **kwargs: Any) -> Any:
    """A dataclass field with ``default`` that is also the command-line flag ``name``
    (keywords: :class:`Flag`'s). A bool field is a bare flag (``invert``: one that sets it
    False)."""
    if isinstance(default, bool):
        kwargs["type"] = bool
    return field(default=default, metadata={"flag": Flag(name, help, **kwargs)})


def declared_options(*classes: type) -> Iterator[tuple[type, dataclasses.Field, Flag]]:
    """(config class, field, flag) of every field of ``classes`` declared with
    :func:`option`, in declaration order."""
    for cls in classes:
        for f in dataclasses.fields(cls):
            if "flag" in f.metadata:
                yield cls, f, f.metadata["flag"]


def build_from(cls: type, values: Any) -> Any:
    """``cls`` built from the attributes of ``values`` (an argparse Namespace) named after its
    declared options' fields; its other fields keep their defaults."""
    return cls(**{f.name: getattr(values, f.name) for _, f, _ in declared_options(cls)})
