"""Schemathesis fuzzes every operation of the server's OpenAPI schema (bounded examples) and
finds no 5xx; afterwards the server is healthy and its KV invariants hold."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.live_server import ServerProcess, assert_healthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(make_tiny_model):
    """The tiny model with a 96-token context: fuzzed bodies may leave max_tokens out, and a
    request with n=64 choices then generates at most ~6k tokens (on a 512-token context one
    such request took 15-19 s, past the fuzzer's 10-s timeout). After the test /health_generate
    answers 200 and the KV invariants hold."""
    path, _ = make_tiny_model("llama")
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "8192",
                      "--context-length", "96")
    yield s
    assert_healthy(s)
    assert s.stop() == 0, "".join(s.log[-40:])


@pytest.mark.unbounded_ok
def test_openapi_fuzz_finds_no_server_error(server):
    exe = shutil.which("schemathesis", path=sys.prefix + "/bin") or shutil.which("schemathesis")
    assert exe, "schemathesis is a dev dependency"
    proc = subprocess.run(  # no example database: every run fuzzes the same cases
        [exe, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", "15", "--workers", "1", "--phases", "examples,fuzzing",
         "--seed", "1234", "--generation-database", "none"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout.split("Test cases:")[-1]
