"""``python -m server --dp-size N``: N server replicas on this machine behind the router.

Each replica is an ordinary ``python -m server`` on a free 127.0.0.1 port, pinned to its share
of the cores (so N replicas do not oversubscribe them) and started with ``--parent-pid`` (it
exits when this process does); the router then serves the public host and port.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from server.front_config import CLI_CONFIGS
from server.options import declared_options

# flags of this process that the replicas must not inherit (name -> takes a value): the ones
# declared with replica=False (the data-parallel front's, and where it listens)
_OWN_FLAGS = {name: flag.takes_value for _, _, flag in declared_options(*CLI_CONFIGS)
              if not flag.replica for name in (flag.name, *flag.aliases)}


def replica_argv(argv: list[str]) -> list[str]:
    """``argv`` without the data-parallel front's own flags (``--flag value`` and
    ``--flag=value`` forms)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = _OWN_FLAGS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_data_parallel(argv: list[str], dp_size: int, host: str, port: int, policy: str,
                        log_level: str, startup_timeout: float = 600.0,
                        parent_pid: int | None = None) -> int:
    """Start the replicas, wait until each answers /health, then run the router until it is
    stopped; the replicas are terminated on the way out. Returns the exit code."""
    from server.router.__main__ import run_router

    cores = sorted(os.sched_getaffinity(0))
    shares = [cores[i::dp_size] or cores for i in range(dp_size)]
    ports = [_free_port() for _ in range(dp_size)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "server", *replica_argv(argv), "--host", "127.0.0.1",
         "--port", str(p), "--parent-pid", str(os.getpid())],
        preexec_fn=lambda share=share: os.sched_setaffinity(0, share))
        for p, share in zip(ports, shares)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        deadline = time.monotonic() + startup_timeout
        for url, proc in zip(urls, procs):
            while True:
                if proc.poll() is not None:
                    print(f"error: replica {url} exited ({proc.returncode})", file=sys.stderr)
                    return 1
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    print(f"error: replica {url} not healthy in {startup_timeout:.0f} s",
                          file=sys.stderr)
                    return 1
                time.sleep(0.2)
        return run_router(urls, host, port, policy, log_level=log_level,
                          parent_pid=parent_pid)  # until SIGTERM, or the parent is gone
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
