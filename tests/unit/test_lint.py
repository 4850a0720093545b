"""ruff over the repository, as configured in pyproject.toml: pyflakes, pycodestyle, import
order, and a docstring on every public class, method and function of ``server/`` and
``sgl_adapters/``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ruff_passes():
    pytest.importorskip("ruff")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache",
                          "--output-format", "concise", REPO], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_docstring_rule_covers_new_modules():
    """A new module with an undocumented public function fails the rule."""
    pytest.importorskip("ruff")
    source = "def shown(x):\n    return x\n"
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--stdin-filename",
                          os.path.join(REPO, "server", "new_module.py"), "-"], input=source,
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1 and "D103" in out.stdout, out.stdout


def long_functions_without_a_reason(root: str, limit: int = 60) -> list[str]:
    """Functions of ``root`` longer than ``limit`` lines whose body does not open (right after
    the docstring) with a comment saying why it is long."""
    import ast

    found = []
    for dirpath, _, files in os.walk(os.path.join(REPO, root)):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
            lines = source.split("\n")
            for node in ast.walk(ast.parse(source)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if node.end_lineno - node.lineno + 1 <= limit:
                    continue
                first = node.body[0]
                doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                       and isinstance(first.value.value, str))
                # the line after the docstring, else the line before the first statement
                at = first.end_lineno if doc else first.lineno - 2  # 0-based
                if not lines[at].strip().startswith("#"):
                    found.append(f"{os.path.relpath(path, REPO)}:{node.lineno} {node.name}")
    return found


@pytest.mark.parametrize("root", ["server", "sgl_adapters"])
def test_long_functions_say_why(root):
    found = long_functions_without_a_reason(root)
    assert not found, "functions over 60 lines without a comment saying why: " + ", ".join(found)


@pytest.mark.parametrize("root", ["server", "sgl_adapters"])
def test_modules_stay_small(root):
    """A module past 400 lines is split by responsibility (the project's rule)."""
    big = []
    for dirpath, _, files in os.walk(os.path.join(REPO, root)):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > 400:
                    big.append(f"{os.path.relpath(os.path.join(dirpath, f), REPO)} ({n})")
    assert not big, "modules over 400 lines: " + ", ".join(big)
