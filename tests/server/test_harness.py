"""The suite's own guards (tests/harness.py): a request without max_tokens fails the test that
sent it, and a test that times out fails with its name, the requests in flight on the live
servers and their log tails."""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from tests.harness import server_report
from tests.live_server import REPO_ROOT, wait_idle


def test_report_names_the_requests_in_flight_and_the_log_tail(tiny_server):
    done = threading.Event()

    def stream():
        body = {"input_ids": [5, 6, 7], "rid": "harness-probe", "stream": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
            with c.stream("POST", "/generate", json=body) as resp:
                for _ in resp.iter_lines():
                    if done.is_set():
                        break  # disconnect: the server aborts the request

    t = threading.Thread(target=stream)
    t.start()
    try:
        for _ in range(200):
            report = server_report()
            if "harness-probe" in report:
                break
            threading.Event().wait(0.02)
        assert "'rid': 'harness-probe'" in report and "'max_new_tokens': 400" in report
        assert "'max_tokens_given': True" in report and "log tail:" in report
        assert tiny_server.url in report
    finally:
        done.set()
        t.join(30)
    wait_idle(tiny_server)


@pytest.mark.unbounded_ok  # the one request without max_tokens is what it checks
def test_server_counts_requests_without_max_tokens(tiny_server):
    before = tiny_server.server_info()["unbounded_requests"]
    with tiny_server.client() as c:
        bounded = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        unbounded = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
        metrics = c.get("/metrics").text
    assert bounded.status_code == unbounded.status_code == 200
    # bounded by the tiny server's 512-token context only
    assert unbounded.json()["usage"]["completion_tokens"] > 0
    assert tiny_server.server_info()["unbounded_requests"] == before + 1
    assert f"sgl_unbounded_requests_total {before + 1}.0" in metrics


INNER = '''
import time

import pytest

from tests.live_server import ServerProcess


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--model", {model!r}, "--dtype", "float32", "--context-length", "512",
                      "--max-total-tokens", "2048")
    yield s
    s.stop()


def test_unbounded(server):
    with server.client() as c:
        c.post("/v1/chat/completions", json={{"messages": [{{"role": "user", "content": "x"}}]}})


@pytest.mark.timeout(3)
def test_hangs(server):
    time.sleep(30)
'''


@pytest.mark.slow
def test_guards_fail_the_offending_tests_by_name(pytester, make_tiny_model, monkeypatch):
    path, _ = make_tiny_model("llama")
    pytester.makepyfile(test_inner=INNER.format(model=path))
    env_path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", REPO_ROOT + (os.pathsep + env_path if env_path else ""))
    result = pytester.runpytest_subprocess("-p", "tests.harness", "-p", "no:cacheprovider",
                                           "-o", "timeout=600", timeout=180)
    out = result.stdout.str()
    result.assert_outcomes(passed=1, failed=1, errors=1)
    assert "gave no max_tokens" in out  # test_unbounded errors at teardown, named
    assert "test_inner.py::test_hangs timed out after 3.0 s" in out
    assert "requests in flight: []" in out and "log tail:" in out
