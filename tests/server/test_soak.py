"""A bounded soak: for ~25 s, mixed clients at once — valid, invalid, streaming, disconnecting,
costly-grammar (a fresh slow regex each time) and 5 MB-prompt clients — against one server.
Afterwards: no 5xx response, no leaked KV, invariants hold, and /health stayed responsive."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from tests.live_server import ServerProcess, wait_idle

pytestmark = pytest.mark.slow
SOAK_S = 15.0


@pytest.fixture(scope="module")
def server(make_tiny_model):
    path, _ = make_tiny_model("llama")
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "4096",
                      "--context-length", "512")
    yield s
    assert s.stop() == 0, "".join(s.log[-40:])


def test_mixed_clients_do_not_hurt_each_other(server):
    deadline = time.monotonic() + SOAK_S
    statuses: list[int] = []
    errors: list[str] = []
    health: list[float] = []
    lock = threading.Lock()

    def record(status: int) -> None:
        with lock:
            statuses.append(status)

    def loop(body):
        def run():
            k = 0
            with httpx.Client(base_url=server.url, timeout=120) as c:
                while time.monotonic() < deadline:
                    try:
                        body(c, k)
                    except httpx.HTTPError as exc:  # noqa: PERF203 - a client-side failure
                        with lock:
                            errors.append(repr(exc))
                    k += 1
        return threading.Thread(target=run)

    def valid(c, k):
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"hello {k}"}], "max_tokens": 8})
        record(r.status_code)

    def invalid(c, k):
        bad = [{"messages": [], "max_tokens": 4}, {"prompt": "x", "temperature": -1},
               {"prompt": "x", "max_tokens": 4, "regex": "("},
               {"prompt": "x", "logprobs": 99}][k % 4]
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        r = c.post(path, json=bad)
        assert 400 <= r.status_code < 500, r.text
        record(r.status_code)

    def streaming(c, k):
        with c.stream("POST", "/v1/completions", json={
                "prompt": f"stream {k}", "max_tokens": 24, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and all("error" not in json.loads(line[6:])
                                                   for line in lines[:-1])
        record(r.status_code)

    def disconnecting(c, k):
        with c.stream("POST", "/generate", json={
                "text": f"cut {k}", "stream": True,
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}) as r:
            for _ in r.iter_lines():
                break  # leave after the first event
        record(r.status_code)

    def costly_grammar(c, k):
        r = c.post("/v1/completions", json={
            "prompt": "g", "max_tokens": 3, "regex": f"(.{{0,{20000 + k}}})x"})
        record(r.status_code)

    def huge_prompt(c, k):
        r = c.post("/v1/completions", json={"prompt": "lorem ipsum " * 400_000,
                                            "max_tokens": 1})
        assert r.status_code == 400, r.text  # longer than the context
        record(r.status_code)

    def poll_health():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while time.monotonic() < deadline:
                start = time.perf_counter()
                assert c.get("/health").status_code == 200
                health.append(time.perf_counter() - start)
                time.sleep(0.05)

    threads = [loop(valid), loop(valid), loop(invalid), loop(streaming), loop(disconnecting),
               loop(costly_grammar), loop(huge_prompt), threading.Thread(target=poll_health)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOAK_S + 120)
    assert not errors, errors[:5]
    assert len(statuses) > 50 and not [s for s in statuses if s >= 500], statuses
    info = wait_idle(server, timeout=30)
    assert info["invariants_ok"] and info["metrics"]["kv_usage"] == 0.0, info
    p99 = statistics.quantiles(health, n=100)[98]
    print(f"\nsoak: {len(statuses)} responses, /health p50 "
          f"{statistics.median(health) * 1e3:.1f} ms p99 {p99 * 1e3:.1f} ms over {len(health)}")
    assert p99 < 0.5, p99
