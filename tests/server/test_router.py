"""The data-parallel router: its prefix tree and policies, then a real router process in front
of two real tiny-model servers (cache-aware placement, streams passed through, failover on a
503, workers added and removed at run time, merged /metrics, a worker killed mid-stream)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from server.router.policy import CacheAware, RoundRobin, WorkerState
from server.router.router import request_key
from server.router.tree import PrefixTree
from sgl_adapters.backends.runtime import Runtime
from tests.live_server import REPO_ROOT, free_port


def test_prefix_tree_matches_splits_and_evicts_lru():
    t = PrefixTree(capacity=20)
    t.insert("hello world")
    t.insert("hello there")  # splits the edge after "hello "
    assert t.match("hello world!") == 11 and t.match("hello th") == 8 and t.match("x") == 0
    assert t.size == len("hello world") + len("there")
    time.sleep(0.01)
    t.insert("hello there")  # touch: "world" is now the least recently used leaf
    t.insert("abcdefgh")  # over capacity: evicts "world"
    assert t.match("hello world") == len("hello ") and t.match("hello there") == 11
    assert t.size <= 20


def test_policies():
    a, b = WorkerState("a", PrefixTree(1000)), WorkerState("b", PrefixTree(1000))
    a.tree.insert("system prompt A: question 1")
    policy = CacheAware()
    assert policy.pick([a, b], "system prompt A: question 2") is a  # longest match
    assert policy.pick([a, b], "unrelated text") is b  # new prefixes go where room is
    a.in_flight, b.in_flight = 40, 2  # unbalanced: least load wins over the match
    assert policy.pick([a, b], "system prompt A: question 3") is b
    rr = RoundRobin()
    assert [rr.pick([a, b], "").url for _ in range(4)] == ["a", "b", "a", "b"]
    assert request_key("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": [
            {"type": "text", "text": "Q"}]}]}) == "<system>S\n<user>Q"
    assert request_key("/v1/responses", {"instructions": "S", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Q"}]}]}) == \
        "<system>S\n<user>Q"
    assert request_key("/v1/responses", {"input": "Q"}) == "<user>Q"
    assert request_key("/generate", {"input_ids": [1, 2]}) == "1,2,"
    assert request_key("/generate", {"text": ["t1", "t2"]}) == "t1"
    assert request_key("/v1/embeddings", {"input": ["t1", "t2"]}) == "t1"
    assert request_key("/encode", {"input_ids": [3]}) == "3,"
    assert request_key("/v1/rerank", {"query": "q", "documents": ["d"]}) == "q"
    assert request_key("/score", {"text_1": ["q1", "q2"], "text_2": ["a", "b"]}) == "q1"


@pytest.fixture(scope="module")
def cluster(make_tiny_model):
    path, _ = make_tiny_model("llama")
    workers = [Runtime(path, dtype="float32", max_total_tokens=4096, context_length=512,
                       log_level="warning", max_queued_requests=1 if i == 0 else 64)
               for i in range(2)]
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "server.router", "--port", str(port), "--policy", "least_load",
         "--health-interval", "0.5", "--parent-pid", str(os.getpid()), "--log-level",
         "warning", "--worker-urls", *[w.base_url for w in workers]], cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and router.poll() is None
        time.sleep(0.1)
    yield url, workers, router
    router.terminate()
    router.wait(30)
    for w in workers:
        w.shutdown()


def _router_with(policy, urls):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.router", "--port", str(port), "--policy", policy,
         "--parent-pid", str(os.getpid()), "--log-level", "warning", "--worker-urls", *urls],
        cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_cache_aware_keeps_each_prefix_on_one_worker(cluster):
    _, workers, _ = cluster
    proc, url = _router_with("cache_aware", [w.base_url for w in workers])
    try:
        prefix = {k: f"Shared few-shot context {k}: " + " ".join(f"w{k}{i}" for i in range(120))
                  for k in "AB"}
        cached = []
        for k, q in (("A", 1), ("A", 2), ("B", 1), ("B", 2)):  # round-robin would split pairs
            r = httpx.post(url + "/generate", timeout=60, json={
                "text": prefix[k] + f" question {q}",
                "sampling_params": {"max_new_tokens": 2}}).json()
            cached.append(r["meta_info"]["cached_tokens"])
        assert cached[1] > 100 and cached[3] > 100  # the second of each pair hit its prefix
        trees = [w["tree_chars"] for w in httpx.get(url + "/workers").json()["workers"]]
        assert all(t > 0 for t in trees)  # A and B went to different workers
    finally:
        proc.terminate()
        proc.wait(30)


def test_chained_responses_follow_the_worker_that_stored_them(cluster):
    """Round robin would send every second turn to the other worker, whose store lacks the
    previous response: chained requests (plain and streamed), GET and DELETE go to its owner."""
    _, workers, _ = cluster
    proc, url = _router_with("round_robin", [w.base_url for w in workers])
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = client.responses.create(model="m", input="Turn 0", max_output_tokens=2)
        owners = set()
        for turn in range(1, 5):
            if turn % 2:
                r = client.responses.create(model="m", input=f"Turn {turn}",
                                            previous_response_id=r.id, max_output_tokens=2)
            else:
                events = list(client.responses.create(
                    model="m", input=f"Turn {turn}", previous_response_id=r.id,
                    max_output_tokens=2, stream=True))
                r = events[-1].response
            owners |= {w.base_url for w in workers
                       if httpx.get(f"{w.base_url}/v1/responses/{r.id}").status_code == 200}
            assert r.previous_response_id and r.usage.input_tokens_details.cached_tokens > 0
        assert len(owners) == 1  # the whole conversation stayed where it started
        assert client.responses.retrieve(r.id).id == r.id
        client.responses.delete(r.id)
        missing = httpx.get(f"{url}/v1/responses/{r.id}")
        assert missing.status_code == 404 and r.id in missing.json()["error"]["message"]
        other = httpx.post(url + "/v1/audio/speech", json={"input": "x"})
        assert other.status_code == 404 and "/v1/audio/speech" in other.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_streams_and_apis_pass_through(cluster):
    url, _, _ = cluster
    client = OpenAI(base_url=url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert client.models.list().data
    r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(url + "/generate", json={"text": "a", "sampling_params": {"n": 0}})
    assert r.status_code == 400  # the worker's own 400 comes back as it is
    r = httpx.post(url + "/generate", content=b"{not json")
    assert r.status_code == 400
    vecs = client.embeddings.create(model="m", input="a").data  # these workers queue one
    assert len(vecs) == 1 and len(vecs[0].embedding) > 0
    r = httpx.post(url + "/encode", json={"text": "a"})
    assert r.status_code == 200
    assert max(abs(x - y) for x, y in zip(r.json()["embedding"], vecs[0].embedding)) < 1e-5
    r = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 413  # forwarded: a document takes two of the one a worker queues
    assert r.json()["error"]["param"] == "documents"


def test_a_503_worker_is_backed_off_and_the_request_fails_over(cluster):
    url, workers, _ = cluster
    busy = workers[0]  # --max-queued-requests 1: one long request fills it
    import threading

    hold = threading.Thread(target=lambda: httpx.post(busy.base_url + "/generate", timeout=120,
                                                      json={"text": "hold", "sampling_params": {
                                                          "max_new_tokens": 300,
                                                          "ignore_eos": True}}))
    hold.start()
    deadline = time.monotonic() + 30
    while httpx.get(busy.base_url + "/server_info").json()["metrics"]["running_requests"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # least_load with nothing in flight through the router picks the first worker: the busy one
    r = httpx.post(url + "/generate", timeout=60, json={"text": "x", "sampling_params": {
        "max_new_tokens": 2}})
    hold.join()
    assert r.status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert any(line.startswith("router_failovers_total") and float(line.split()[-1]) >= 1
               for line in metrics.splitlines())
    # merged worker metrics carry a worker label, one series per worker
    for w in workers:
        assert f'worker="{w.base_url}"' in metrics


def test_workers_are_added_and_removed_at_run_time(cluster):
    url, workers, _ = cluster
    second = workers[1].base_url
    assert httpx.delete(url + "/workers", params={"url": second}).json() == {"removed": second}
    assert [w["url"] for w in httpx.get(url + "/workers").json()["workers"]] == \
        [workers[0].base_url]
    assert httpx.delete(url + "/workers", params={"url": second}).status_code == 404
    assert httpx.post(url + "/workers", json={"url": second}).json() == {"added": second}
    assert len(httpx.get(url + "/workers").json()["workers"]) == 2
    assert httpx.post(url + "/workers", json={"url": "nope"}).status_code == 400
    bad = httpx.post(url + "/workers", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"


def test_a_worker_killed_mid_stream(cluster):
    """The client of the broken stream gets an error event and [DONE]; the router takes the
    worker out and keeps serving with the other."""
    url, workers, _ = cluster
    with httpx.stream("POST", url + "/generate", timeout=120, json={
            "text": "long", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["text"] is not None
        serving = [w for w in httpx.get(url + "/workers").json()["workers"]
                   if w["in_flight"] == 1]
        assert len(serving) == 1
        victim = next(w for w in workers if w.base_url == serving[0]["url"])
        os.kill(victim.proc.pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert "error" in json.loads(rest[-2][5:])
    for _ in range(5):  # the other worker may still be backed off (an earlier 503): retry
        r = httpx.post(url + "/generate", timeout=60, json={
            "text": "still there?", "sampling_params": {"max_new_tokens": 2}})
        if r.status_code != 503:
            break
        time.sleep(float(r.headers["retry-after"]))
    assert r.status_code == 200
    healthy = {w["url"]: w["healthy"] for w in httpx.get(url + "/workers").json()["workers"]}
    assert healthy[victim.base_url] is False
