"""``Runtime``: start the bundled server from Python and use it as a backend.

    with sgl.Runtime(max_total_tokens=16384) as rt:   # the embedded default model
        sgl.set_default_backend(rt)
        ...

The server runs as ``python -m server`` in a subprocess on a free 127.0.0.1 port (the only
place ``sgl_adapters`` touches the server package, and only by module name). Keyword arguments
become CLI flags (``max_total_tokens=16384`` -> ``--max-total-tokens 16384``; ``True`` -> a
bare flag). ``shutdown()`` (also on exit of the ``with`` block and at interpreter exit) sends
SIGTERM and waits for the server to drain.
"""

from __future__ import annotations

import atexit
import collections
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import httpx

from sgl_adapters.backends.runtime_endpoint import RuntimeEndpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_flags(model: str | None, server_args: dict[str, Any]) -> list[str]:
    """CLI flags for ``python -m server`` from keyword arguments."""
    flags = ["--model", model] if model else []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value not in (False, None):
            flags += [flag, str(value)]
    return flags


class Runtime(RuntimeEndpoint):
    """The bundled server in a subprocess, usable wherever a backend is.

    Args:
        model: HF directory or .gguf file; None = the embedded SmolLM2-135M-Instruct.
        startup_timeout: seconds to wait for ``/health`` (model loading included).
        extra_args: more CLI flags, as given on a command line.
        cwd: working directory of the server process.
        **server_args: any ``python -m server`` flag, e.g. ``max_total_tokens=16384``.

    This is the one launcher (tests and benchmarks use it too): ready means ``/health``
    answers 200, and the server exits when the process that started it is gone.
    Raises RuntimeError when the server exits or is not healthy within ``startup_timeout``
    (the message ends with the server's last output lines).
    """

    def __init__(self, model: str | None = None, startup_timeout: float = 300.0,
                 extra_args: Sequence[str] = (), cwd: str | None = None, **server_args: Any):
        api_key = server_args.get("api_key")
        self.port = server_args.pop("port", None) or _free_port()
        self.log: collections.deque[str] = collections.deque(maxlen=2000)
        # --parent-pid: the server drains and exits if this process dies (even by SIGKILL)
        cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--parent-pid", str(os.getpid()), *server_flags(model, server_args),
               *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=cwd)
        threading.Thread(target=self._pump, daemon=True).start()
        super().__init__(f"http://127.0.0.1:{self.port}", api_key=api_key)
        atexit.register(self.shutdown)
        self._wait_healthy(startup_timeout)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.shutdown()
        raise RuntimeError("the server did not become healthy:\n" + "".join(list(self.log)[-30:]))

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` seconds); idempotent."""
        super().shutdown()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
