"""The scheduler process's entry point, importable without torch: the HTTP process names it as
the target of the spawned child, and only the child imports the model stack."""

from __future__ import annotations

from typing import Any


def run_scheduler(*args: Any) -> None:
    """Spawn target: :func:`server.scheduler.loop.run_scheduler_process` (same arguments)."""
    from server.scheduler.loop import run_scheduler_process

    run_scheduler_process(*args)
