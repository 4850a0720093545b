"""docs/design.md's module map names every module, and only modules that exist.

The map is the fenced block of its section 2: one entry a line, ``name/`` for a directory and
``name.py`` for a module, indented two spaces per level under its directory; a line that is
neither (a description's continuation, ``Makefile, .ci/run``) is skipped. Package
``__init__.py`` files may be left out (the directory's line stands for them)."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAPPED = ("server", "kernels", "sgl_adapters", "examples", "benchmarks")
ENTRY = re.compile(r"^( *)([\w.]+(?:/|\.py))(?:\s|$)")


def mapped_paths(text: str) -> set[str]:
    """The repository paths the map's entries name (directories end with "/")."""
    block = text.split("```")[1]
    paths, stack = set(), []  # stack: (indent, directory path)
    for line in block.splitlines():
        m = ENTRY.match(line)
        if m is None:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        paths.add(path)
        if name.endswith("/"):
            stack.append((indent, path))
    return paths


def modules() -> set[str]:
    found = set()
    for package in MAPPED:
        for root, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            found.update(os.path.relpath(os.path.join(root, f), REPO).replace(os.sep, "/")
                         for f in files if f.endswith(".py"))
    return found


def design() -> str:
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as f:
        return f.read()


def test_the_parser_follows_indentation():
    text = "```\nserver/   x\n  a.py    y\n  http/\n    b.py  z\n          continued\nk/\n  c.py\n```"
    assert mapped_paths(text) == {"server/", "server/a.py", "server/http/", "server/http/b.py",
                                  "k/", "k/c.py"}


def test_every_module_is_in_the_map():
    mapped = mapped_paths(design())
    missing = sorted(m for m in modules() - mapped if not m.endswith("/__init__.py"))
    assert not missing, f"modules missing from docs/design.md's map: {missing}"


def test_every_mapped_module_exists():
    stale = sorted(p for p in mapped_paths(design())
                   if p.endswith(".py") and p.split("/")[0] in MAPPED
                   and not os.path.exists(os.path.join(REPO, p)))
    assert not stale, f"docs/design.md maps modules that do not exist: {stale}"
