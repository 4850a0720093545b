"""Live servers for the tests: ``python -m server`` subprocesses on free 127.0.0.1 ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

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
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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


@pytest.fixture(scope="session")
def tiny_server(make_tiny_model):
    """A server on the tiny random Llama (fp32), shared by most tests."""
    path, _ = make_tiny_model("llama")
    server = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "4096",
                           "--context-length", "512")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


@pytest.fixture(scope="session")
def default_server():
    """A server on the embedded SmolLM2-135M-Instruct."""
    server = ServerProcess("--max-total-tokens", "16384")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


@pytest.fixture
def healthy(tiny_server):
    """After the test: /health_generate answers 200 and the KV invariants hold."""
    yield tiny_server
    with tiny_server.client() as c:
        assert c.get("/health_generate").status_code == 200
    info = wait_idle(tiny_server)
    assert info["invariants_ok"], info
    assert info["metrics"]["kv_usage"] == 0.0, info
