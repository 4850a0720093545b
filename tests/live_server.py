"""Live servers for the tests: ``python -m server`` subprocesses on free 127.0.0.1 ports.

(Not :class:`sgl_adapters.Runtime`: fault tests need the log, signals and the scheduler pid.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

READY_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess; ``url`` once ready. Output is kept in ``self.log`` lines."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(self.port), "--log-level", "warning",
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self.log.append(line)
                if "server ready:" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + "".join(self.log[-40:]))

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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
