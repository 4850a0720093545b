"""Live servers for the tests: ``python -m server`` subprocesses on free 127.0.0.1 ports,
started by :class:`sgl_adapters.backends.runtime.Runtime` (the one launcher: ready when
``/health`` answers, and the server exits when the test process dies, even by SIGKILL).
:class:`ServerProcess` adds what fault tests need: the log, signals and the scheduler pid.
Running ones are listed by :func:`live_servers` (for ``tests/harness.py``'s checks).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import weakref

import httpx

from sgl_adapters.backends.runtime import Runtime

READY_TIMEOUT_S = 180
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


def live_servers() -> list["ServerProcess"]:
    """The ServerProcesses of this test process whose server is still running."""
    return [s for s in list(_LIVE) if s.proc.poll() is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess (``args``: its CLI flags); ``url`` once ready. Output lines are
    kept in ``self.log``."""

    def __init__(self, *args: str):
        self.args = args
        self.runtime = Runtime(None, startup_timeout=READY_TIMEOUT_S,
                               extra_args=["--log-level", "warning", *args], cwd=REPO_ROOT)
        self.proc = self.runtime.proc
        self.port = self.runtime.port
        self.url = self.runtime.base_url
        self.unbounded_seen = 0  # /server_info's unbounded_requests at the last check
        _LIVE.add(self)
        deadline = time.monotonic() + 10  # the ready line follows /health by a few ms
        while not (ready := [line for line in self.log if "server ready:" in line]):
            if time.monotonic() > deadline:
                raise RuntimeError("no ready line:\n" + "".join(self.log[-40:]))
            time.sleep(0.02)
        self.ready_line = ready[0]  # kept: the log is a bounded tail

    @property
    def log(self) -> list[str]:
        return list(self.runtime.log)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def server_info(self, timeout: float = 10.0) -> dict:
        """GET /server_info (with the server's --api-key, if any). Raises httpx.HTTPError."""
        key = self.args[self.args.index("--api-key") + 1] if "--api-key" in self.args else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        resp = httpx.get(self.url + "/server_info", headers=headers, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.runtime.shutdown()
        return self.proc.returncode

    def scheduler_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()]
        for pid in pids:  # the spawned scheduler runs multiprocessing's spawn entry point
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():  # not the resource tracker
                    return pid
        raise RuntimeError(f"no scheduler child among {pids}")


def wait_idle(server: ServerProcess, timeout: float = 5.0) -> dict:
    """Poll /server_info until nothing runs or waits and no request holds KV; returns it."""
    deadline = time.monotonic() + timeout
    with server.client() as c:
        while True:
            info = c.get("/server_info").json()
            m = info["metrics"]
            if (m["running_requests"] == 0 and m["waiting_requests"] == 0
                    and m["kv_usage"] == 0.0) or time.monotonic() > deadline:
                return info
            time.sleep(0.05)


def assert_healthy(server: ServerProcess) -> None:
    """/health_generate answers 200, and once idle the KV invariants hold and no KV is held."""
    with server.client() as c:
        assert c.get("/health_generate").status_code == 200
    info = wait_idle(server)
    assert info["invariants_ok"], info
    assert info["metrics"]["kv_usage"] == 0.0, info
