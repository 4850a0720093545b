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
