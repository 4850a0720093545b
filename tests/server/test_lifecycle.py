"""Process faults (RELIABILITY): the scheduler process killed mid-flight, and SIGTERM with
streams in flight. Each test owns its server."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.live_server import ServerProcess


@pytest.fixture
def server(make_tiny_model):
    path, _ = make_tiny_model("llama")
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "16384",
                      "--context-length", "512", "--shutdown-timeout", "60",
                      "--max-running-requests", "4")  # streams queue up: slow enough to interrupt
    yield s
    s.stop(signal.SIGKILL)


def _stream(url: str, results: list, i: int) -> None:
    body = {"input_ids": [5 + i, 6, 7], "stream": True,
            # sampled: greedy text repeats itself and n-gram drafts would finish it too soon
            "sampling_params": {"max_new_tokens": 500, "temperature": 1.0, "seed": i,
                                "ignore_eos": True}}
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            with c.stream("POST", "/generate", json=body) as resp:
                status, last = resp.status_code, None
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
                results.append((status, last, time.monotonic()))
    except httpx.HTTPError as exc:
        results.append((None, repr(exc), time.monotonic()))


def _start_streams(url, n, server=None, mid_stream=False):
    """n streaming requests on threads; with ``server``, returns once the server serves all n
    (its /server_info lists them), so a fault injected next meets them all in flight; with
    ``mid_stream`` also, once one of them has produced output and has most of it still to come
    (on a fast machine the first wave of the tiny model's streams could finish while the later
    ones were still connecting, and a fault then met only streams with no output yet)."""
    results: list = []
    threads = [threading.Thread(target=_stream, args=(url, results, i)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    all_seen = False  # once all n were listed (finished ones then leave the list)
    while server is not None:
        reqs = server.server_info()["requests"]
        all_seen = all_seen or len(reqs) == n
        if all_seen and (not mid_stream or any(
                0 < r["completion_tokens"] < r["max_new_tokens"] // 2 for r in reqs)):
            break
        assert time.monotonic() < deadline, "the streams never all reached the server"
        time.sleep(0.02)
    return results, threads


def test_scheduler_killed_fails_requests_and_exits_nonzero(server):
    results, threads = _start_streams(server.url, 16, server, mid_stream=True)
    killed_at = time.monotonic()
    os.kill(server.scheduler_pid(), signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(results) == 16
    # Streams already answering end with an SSE error event (not a silently cut connection);
    # those still waiting for their first token get a 503 before any header.
    started = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(started) + len(refused) == 16, results
    cut = [r for r in started if "error" in r[1]]
    assert cut, "every stream finished before the kill; make them longer"
    assert all(r[1]["error"]["code"] == "unavailable" for r in cut)
    assert all(r[1]["meta_info"]["finish_reason"] for r in started if r not in cut)
    assert all(r[2] - killed_at < 5 for r in results)  # nobody hangs
    assert server.proc.wait(30) != 0


def test_sigterm_drains_in_flight_streams_then_exits_zero(server):
    results, threads = _start_streams(server.url, 12, server)  # 3 waves of 4 running
    server.proc.send_signal(signal.SIGTERM)
    sent_at = time.monotonic()
    time.sleep(0.3)
    # while draining the listener stays open: new requests (health checks too) get 503 with
    # Retry-After, so a load balancer sees the replica leave instead of connection errors
    resp = httpx.get(server.url + "/health", timeout=5)
    assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1, resp.text
    assert resp.json()["error"]["code"] == "unavailable"
    for t in threads:
        t.join(90)
    assert len(results) == 12
    finished = [r for r in results if r[0] == 200 and isinstance(r[1], dict)
                and r[1]["meta_info"]["finish_reason"] == {"type": "length"}]
    assert len(finished) == 12, results[:3]
    assert any(r[2] > sent_at + 0.2 for r in results), "streams ended before SIGTERM mattered"
    assert server.proc.wait(60) == 0
    assert "scheduler" not in os.popen(f"pgrep -P {server.proc.pid} -a").read()


def test_drain_deadline_ends_streams_with_an_error_event(make_tiny_model):
    """Streams still running when the drain time is over end with an SSE error event and
    [DONE], not a cut connection; the server then exits 0."""
    path, _ = make_tiny_model("llama")
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "16384",
                      "--context-length", "512", "--shutdown-timeout", "0.5")
    try:
        done: list = []
        started = [threading.Event() for _ in range(4)]

        def stream(i):
            body = {"input_ids": [5 + i, 6, 7], "stream": True, "sampling_params": {
                "max_new_tokens": 500, "temperature": 0, "ignore_eos": True}}
            with httpx.Client(base_url=s.url, timeout=60) as c:
                with c.stream("POST", "/generate", json=body) as resp:
                    lines = []
                    for line in resp.iter_lines():
                        lines.append(line)
                        started[i].set()
                    done.append((resp.status_code, lines))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started), "the streams never started"
        s.proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        for t in threads:
            t.join(30)
        assert len(done) == 4 and time.monotonic() - sent_at < 15
        cut = 0
        for status, lines in done:
            events = [ln for ln in lines if ln.startswith("data: ")]
            assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
            last = json.loads(events[-2][6:])
            if "error" in last:  # cut by the drain's end, with the reason
                cut += 1
                assert last["error"]["code"] == "unavailable"
                assert "shutting down" in last["error"]["message"]
            else:
                assert last["meta_info"]["finish_reason"] == {"type": "length"}
        assert cut, "every stream finished within 0.5 s; make them longer"
        assert s.proc.wait(30) == 0
    finally:
        s.stop(signal.SIGKILL)


def test_full_queue_answers_503_with_retry_after(make_tiny_model):
    path, _ = make_tiny_model("llama")
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "4096",
                      "--context-length", "512", "--max-queued-requests", "2",
                      "--max-running-requests", "1")
    try:
        results, threads = _start_streams(s.url, 2, s)  # fill the queue with two long streams
        with s.client() as c:
            resp = c.post("/generate", json={"text": "one more"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "server_error"
        for t in threads:
            t.join(60)
        with s.client() as c:  # capacity is back once the queue drains
            assert c.post("/generate", json={"text": "now",
                                             "sampling_params": {"max_new_tokens": 1}}).is_success
    finally:
        assert s.stop() == 0


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_server_and_scheduler_exit_when_their_launcher_is_killed(make_tiny_model):
    """A process that started a server with sgl.Runtime dies by SIGKILL (as a killed
    ``make test`` does): the server and its scheduler exit on their own."""
    import subprocess
    import sys

    from tests.live_server import REPO_ROOT

    path, _ = make_tiny_model("llama")
    code = ("import time\nfrom sgl_adapters.backends.runtime import Runtime\n"
            f"rt = Runtime({path!r}, dtype='float32', max_total_tokens=1024, "
            "context_length=256)\nprint(rt.proc.pid, flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                text=True, cwd=REPO_ROOT)
    server_pid = int(launcher.stdout.readline())
    children = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True,
                              text=True).stdout.split()
    assert children, "no scheduler process"
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while not all(_gone(p) for p in [server_pid, *map(int, children)]):
        assert time.monotonic() < deadline, "the orphaned server is still running"
        time.sleep(0.2)


def test_the_http_process_holds_no_torch(tiny_server):
    """The process boundary is real: the HTTP process (tokenizer, routes) never loads torch;
    the scheduler process does."""
    with open(f"/proc/{tiny_server.proc.pid}/maps") as f:
        http_maps = f.read()
    with open(f"/proc/{tiny_server.scheduler_pid()}/maps") as f:
        scheduler_maps = f.read()
    assert "libtorch" in scheduler_maps
    assert "libtorch" not in http_maps


def test_the_scheduler_starts_with_the_openmp_wait_it_needs(tiny_server):
    """The scheduler process loads OpenMP with ``GOMP_SPINCOUNT`` set (the module's value, or
    the one the user exported): with libgomp's default spin a forward pass on two threads took
    1-2 s while another process used a core (server.model.cpu_threads)."""
    from server.model.cpu_threads import GOMP_SPIN_COUNT

    with open(f"/proc/{tiny_server.scheduler_pid()}/environ", "rb") as f:
        environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    assert environ.get(b"GOMP_SPINCOUNT", b"").decode() == \
        os.environ.get("GOMP_SPINCOUNT", GOMP_SPIN_COUNT)


def test_a_stream_whose_client_stops_reading_is_aborted(make_tiny_model):
    """Top-20 logprobs streamed to a client that stops reading: the server stops pulling the
    request's outputs (backpressure), keeps answering, and aborts it in the scheduler once its
    output has waited --stream-stall-timeout unread (KV freed); a client that reads again gets
    what was sent, the backlog as one chunk, then a 408 error event."""
    path, _ = make_tiny_model("llama", max_position_embeddings=4096)
    # 4,000 tokens: far more than a tiny model decodes in the 0.5 s stall timeout (500 could
    # finish first once nothing else ran on the server's cores at start-up)
    s = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "8192",
                      "--context-length", "4096", "--stream-stall-timeout", "0.5")
    try:
        body = {"input_ids": [5, 6, 7], "stream": True, "return_logprob": True,
                "top_logprobs_num": 20, "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
        small_buffer = httpx.HTTPTransport(  # the server's writes block soon after we stop
            socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)])
        with httpx.Client(base_url=s.url, timeout=60, transport=small_buffer) as c:
            with c.stream("POST", "/generate", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: {")
                health, deadline = [], time.monotonic() + 30
                while True:  # read nothing until the scheduler has let it go
                    metrics = s.server_info()["metrics"]
                    if metrics["running_requests"] == 0:
                        break
                    assert time.monotonic() < deadline, "the unread stream was never aborted"
                    t0 = time.monotonic()
                    assert httpx.get(s.url + "/health", timeout=5).status_code == 200
                    health.append(time.monotonic() - t0)
                    time.sleep(0.1)
                assert max(health, default=0) < 1.0, health
                assert metrics["aborts"] == 1 and metrics["generated_tokens"] < 4000, metrics
                assert metrics["kv_usage"] == 0
                events = [ln for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "408" and "read no output" in error["message"], error
        chunks = [json.loads(e[6:]) for e in events[:-2]]
        assert chunks and all(c["meta_info"]["finish_reason"] is None for c in chunks)
        assert len(chunks[-1]["output_ids"]) < 4000  # cut, not run to max_new_tokens
    finally:
        s.stop()
