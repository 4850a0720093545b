"""Helpers shared by the benchmarks: where the shared data lives, and table printing."""

from __future__ import annotations

import os
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_data_dir() -> str | None:
    """``../shared/data`` next to the repository (DESIGN.md §6), or None when absent."""
    path = os.path.join(os.path.dirname(REPO_ROOT), "shared", "data")
    return path if os.path.isdir(path) else None


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a markdown table (pasteable into README.md)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    print(fmt.format(*header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(fmt.format(*row))
