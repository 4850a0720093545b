"""Schemathesis fuzzes every operation of the server's OpenAPI schema (bounded examples) and
finds no 5xx; afterwards the server is healthy and its KV invariants hold."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


# fuzzed bodies may leave max_tokens out: the tiny server's 512-token context bounds them
@pytest.mark.unbounded_ok
def test_openapi_fuzz_finds_no_server_error(healthy):
    exe = shutil.which("schemathesis", path=sys.prefix + "/bin") or shutil.which("schemathesis")
    assert exe, "schemathesis is a dev dependency"
    proc = subprocess.run(
        [exe, "run", f"{healthy.url}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", "15", "--workers", "1", "--phases", "examples,fuzzing",
         "--seed", "1234"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout.split("Test cases:")[-1]
