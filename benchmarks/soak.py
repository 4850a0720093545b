"""Hostile soak: 24 clients at once for ``--seconds`` (default 300) against one server on the
default model: well-behaved chat, streaming and JSON clients next to the abuse issue 34 lists
(ReDoS stop_regex, multi-MB schemas, streams whose reader stops, long forced strings for
jump-forward, slow grammar compiles, lone surrogates, grammars matching nothing or dead-ending,
oversized batches and chunked bodies, forced tool calls without tools or on array schemas,
disconnects, aborts of unknown ids).

    python -m benchmarks.soak [--seconds 300] [--only kind,...] [--burners N]

Prints the CPU class, then: responses by status (5xx must be 0), /health latency p50/p99/max
(polled every 50 ms), the longest gap between events of a well-behaved stream, the server's
RSS (HTTP process plus children) after a warm-up round and after the soak once idle, the CPU
seconds the server and the client processes used (they share the machine's CPUs), and the
KV usage once idle. ``--burners N`` adds N processes that only spin: with
``--only chat,stream,json_client`` it measures what losing that much CPU does to the streams
without any hostile request. Exit code 1 when a goal of the issue is missed: 0 5xx, /health
p99 < 100 ms and max < 1 s, no stream gap > 1 s, RSS within 10 % of its start (net of the KV
pages of tokens the radix cache gained: the pool is paged in as it fills, by design), KV usage
back to 0.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import threading
import time
from collections import Counter
from typing import Callable

import httpx

from benchmarks.common import REPO_ROOT
from kernels.cpu_features import cpu_description
from sgl_adapters.backends.runtime import Runtime

CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
MSG = [{"role": "user", "content": "Name a colour."}]
HUGE_SCHEMA_BODY = json.dumps({"messages": MSG, "max_tokens": 4, "response_format": {
    "type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(60000)}}}}}).encode()  # ~2 MB
MEBIBYTE = b"x" * (1 << 20)


def tree_usage(pid: int) -> tuple[dict[str, float], float]:
    """(RSS in MB of ``pid`` and its descendants by role ("http", "scheduler", "grammar
    compile", ...; shared pages counted once per process) with their "total", CPU seconds
    the living ones have used)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,rss=,times=,args="], capture_output=True,
                         text=True).stdout
    children: dict[int, list[int]] = {}
    rows = {}
    for line in out.splitlines():
        p, pp, r, cpu, args = line.split(None, 4)
        children.setdefault(int(pp), []).append(int(p))
        rows[int(p)] = (int(r) / 1024, int(cpu), args)
    roles: Counter = Counter()
    cpu_s = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in rows:
            mb, cpu, args = rows[p]
            role = ("http" if p == pid else "scheduler" if "spawn_main" in args
                    else "grammar compile" if "forkserver" in args else "other")
            roles[role] += mb
            cpu_s += cpu
        stack.extend(children.get(p, []))
    roles["total"] = sum(roles.values())
    return dict(roles), cpu_s


class Soak:
    def __init__(self, url: str, seconds: float, only: set[str] | None = None,
                 burners: int = 0):
        self.url, self.seconds, self.only, self.burners = url, seconds, only, burners
        self.client_cpu_s = 0.0  # CPU seconds the client processes used in run()
        self.statuses: Counter = Counter()
        self.five_xx: list[str] = []
        self.client_errors: list[str] = []
        self.health: list[float] = []
        self.gaps: list[float] = []
        self.lock = threading.Lock()
        self.deadline = 0.0

    def record(self, kind: str, resp: httpx.Response) -> None:
        with self.lock:
            self.statuses[resp.status_code] += 1
            if resp.status_code >= 500:
                self.five_xx.append(f"{kind}: {resp.status_code} {resp.text[:200]}")

    # ------------------------------------------------------------ well-behaved clients
    def chat(self, c: httpx.Client, k: int) -> None:
        self.record("chat", c.post(CHAT, json={"messages": MSG, "max_tokens": 16,
                                               "temperature": 0.7, "seed": k}))

    def stream(self, c: httpx.Client, k: int) -> None:
        body = {"prompt": f"Story {k}:", "max_tokens": 48, "stream": True, "temperature": 0.8,
                "seed": k}
        with c.stream("POST", CMPL, json=body) as r:
            last, gaps = None, []
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: "):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        with self.lock:
            self.gaps.extend(gaps)
        self.record("stream", r)

    def json_client(self, c: httpx.Client, k: int) -> None:
        schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12},
                                                   "n": {"type": "integer"}},
                  "required": ["colour", "n"]}
        self.record("json", c.post(CHAT, json={"messages": MSG, "max_tokens": 40, "response_format": {
            "type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}))

    # ------------------------------------------------------------ hostile clients
    def redos(self, c: httpx.Client, k: int) -> None:
        self.record("redos", c.post(GEN, json={"text": "x", "sampling_params": {
            "max_new_tokens": 30, "regex": "a{25}", "stop_regex": ["(a+)+c", "(a|aa)+c"][k % 2]}}))

    def huge_schema(self, c: httpx.Client, k: int) -> None:
        self.record("huge_schema", c.post(CHAT, content=HUGE_SCHEMA_BODY,
                                          headers={"content-type": "application/json"}))

    def stalled_stream(self, c: httpx.Client, k: int) -> None:
        body = {"text": f"stall {k}", "stream": True, "return_logprob": True,
                "top_logprobs_num": 20, "return_text_in_logprobs": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        with c.stream("POST", GEN, json=body) as r:
            for _ in r.iter_lines():
                break
            time.sleep(5)  # stop reading, then go away
        self.record("stalled_stream", r)

    def forced_strings(self, c: httpx.Client, k: int) -> None:
        if k % 3 == 0:
            name = "f" * 1000
            r = c.post(CHAT, json={"messages": MSG, "max_tokens": 200, "tools": [
                {"type": "function", "function": {"name": name, "parameters": {}}}],
                "tool_choice": {"type": "function", "function": {"name": name}}})
        elif k % 3 == 1:
            r = c.post(GEN, json={"text": "x", "sampling_params": {
                "max_new_tokens": 200, "json_schema": {"enum": ["v" * 30000, "w"]}}})
        else:
            r = c.post(GEN, json={"text": "x", "sampling_params": {
                "max_new_tokens": 200, "regex": "a{1000000}"}})
        self.record("forced_strings", r)

    def slow_grammar(self, c: httpx.Client, k: int) -> None:
        regex = f'[^"]{{1,{20000 + k}}}' if k % 2 else f"[a-z0-9 ]{{1,{30000 + k}}}"
        self.record("slow_grammar", c.post(GEN, json={"text": "x", "sampling_params": {
            "max_new_tokens": 2, "regex": regex}}))

    def surrogates(self, c: httpx.Client, k: int) -> None:
        sp = '"sampling_params": {"max_new_tokens": 1%s}'
        body = ['{"text": "x", %s}' % (sp % ', "stop": ["\\ud800"]'),
                '{"text": "x", %s}' % (sp % ', "regex": "a\\udc00"'),
                '{"text": "x", "rid": "r\\ud800", %s}' % (sp % ""),
                '{"text": "x", "cache_salt": "\\ud800", %s}' % (sp % "")][k % 4]
        self.record("surrogates", c.post(GEN, content=body.encode(),
                                         headers={"content-type": "application/json"}))

    def bad_grammars(self, c: httpx.Client, k: int) -> None:
        spec = [{"regex": r"[^\s\S]"}, {"ebnf": 'root ::= "a" x\nx ::= x "c"'}][k % 2]
        self.record("bad_grammars", c.post(GEN, json={"text": "x", "sampling_params": {
            "max_new_tokens": 8, **spec}}))

    def oversized(self, c: httpx.Client, k: int) -> None:
        if k % 2:
            r = c.post(GEN, json={"text": ["x"] * 1010, "sampling_params": {"max_new_tokens": 1}})
        else:
            def chunks():
                yield b'{"messages": [{"role": "user", "content": "'
                for _ in range(9):
                    yield MEBIBYTE
                yield b'"}]}'
            r = c.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        self.record("oversized", r)

    def tools(self, c: httpx.Client, k: int) -> None:
        tools = [None, [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "array", "items": {"type": "integer"}}}}]][k % 2]
        self.record("tools", c.post(CHAT, json={"messages": MSG, "max_tokens": 8, "tools": tools,
                                                "tool_choice": "required"}))

    def disconnect(self, c: httpx.Client, k: int) -> None:
        with c.stream("POST", GEN, json={"text": f"cut {k}", "stream": True, "sampling_params": {
                "max_new_tokens": 200, "ignore_eos": True}}) as r:
            for _ in r.iter_lines():
                break
        self.record("disconnect", r)
        self.record("abort", c.post("/abort_request", json={"rid": f"unknown-{k}"}))

    # ------------------------------------------------------------ running
    def client(self, fn: Callable, once: bool = False) -> threading.Thread:
        def run() -> None:
            k = 0
            with httpx.Client(base_url=self.url, timeout=180) as c:
                while once or time.monotonic() < self.deadline:
                    try:
                        fn(c, k)
                    except httpx.HTTPError as exc:  # noqa: PERF203 - counted, not fatal
                        with self.lock:
                            self.client_errors.append(f"{fn.__name__}: {exc!r}")
                    k += 1
                    if once:
                        return
        return threading.Thread(target=run, name=fn.__name__)

    KINDS = ["chat"] * 4 + ["stream"] * 4 + ["json_client"] * 2 + [
        "redos", "huge_schema", "stalled_stream", "stalled_stream", "forced_strings",
        "forced_strings", "slow_grammar", "slow_grammar", "surrogates", "bad_grammars",
        "oversized", "tools", "disconnect"]

    def mix(self) -> list[str]:
        """The kinds of the 23 clients (the 24th polls /health); with ``only``, those named."""
        return [k for k in self.KINDS if self.only is None or k in self.only]

    def warm_up(self) -> None:
        """Each kind once, one after another."""
        for kind in dict.fromkeys(self.mix()):
            self.client(getattr(self, kind), once=True).run()

    def run(self) -> None:
        """Every client and the /health poller in a process of its own, so one client's work
        on its GIL (a 9 MB chunked upload, a 2 MB body) is not counted as another's latency."""
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=run_client, args=(self.url, kind, self.seconds, results))
                 for kind in self.mix()]
        procs.append(ctx.Process(target=poll_health, args=(self.url, self.seconds, results)))
        procs += [ctx.Process(target=burn, args=(self.seconds, results))
                  for _ in range(self.burners)]
        for p in procs:
            p.start()
        for _ in procs:
            kind, statuses, five_xx, errors, samples, cpu_s = results.get(
                timeout=self.seconds + 600)
            self.client_cpu_s += cpu_s
            self.statuses.update(statuses)
            self.five_xx += five_xx
            self.client_errors += errors
            (self.health if kind == "health" else self.gaps).extend(samples)
        for p in procs:
            p.join(30)


def run_client(url: str, kind: str, seconds: float, results) -> None:
    """One client of ``kind`` (a Soak method) looping for ``seconds``; puts (kind, statuses,
    5xx lines, client-side errors, stream gaps in s)."""
    soak = Soak(url, seconds)
    soak.deadline = time.monotonic() + seconds
    soak.client(getattr(soak, kind)).run()
    results.put((kind, soak.statuses, soak.five_xx, soak.client_errors, soak.gaps,
                 time.process_time()))


def burn(seconds: float, results) -> None:
    """Spin a CPU for ``seconds`` sending nothing (``--burners``: the control for how much
    losing CPU to other processes alone stretches the streams' gaps)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass
    results.put(("burner", Counter(), [], [], [], time.process_time()))


def poll_health(url: str, seconds: float, results) -> None:
    """GET /health every 50 ms for ``seconds``; puts ("health", {}, non-200 lines, [],
    latencies in s)."""
    latencies, bad = [], []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=30) as c:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            status = c.get("/health").status_code
            latencies.append(time.perf_counter() - start)
            if status != 200:
                bad.append(f"health: {status}")
            time.sleep(0.05)
    results.put(("health", Counter(), bad, [], latencies, time.process_time()))


def wait_idle(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/server_info", timeout=30).json()
        if not info["requests"] and info["metrics"]["running_requests"] == 0 \
                and info["metrics"]["waiting_requests"] == 0:
            return info
        if time.monotonic() > deadline:
            return info
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--only", default=None, help="comma-separated client kinds (method names, "
                    "e.g. chat,stream,redos) to run instead of the whole mix")
    ap.add_argument("--burners", type=int, default=0, help="processes that only spin a CPU "
                    "(a control: with --only chat,stream,json_client, the gaps that losing CPU "
                    "alone causes)")
    ap.add_argument("--server-args", default="", help="extra server flags, one string "
                    "(e.g. \"--cpu-threads 1\")")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}")
    rt = Runtime(None, extra_args=["--log-level", "warning", *args.server_args.split()],
                 cwd=REPO_ROOT)
    try:
        soak = Soak(rt.base_url, args.seconds,
                    set(args.only.split(",")) if args.only else None, args.burners)
        soak.warm_up()
        cached_start = wait_idle(rt.base_url)["metrics"]["kv_cached_tokens"]
        soak.statuses.clear()
        soak.five_xx.clear()
        soak.client_errors.clear()
        rss_start, cpu_start = tree_usage(rt.proc.pid)
        started = time.monotonic()
        soak.run()
        elapsed = time.monotonic() - started
        _, cpu_run = tree_usage(rt.proc.pid)
        info = wait_idle(rt.base_url)
        time.sleep(2)
        rss_end, _ = tree_usage(rt.proc.pid)
    finally:
        rt.shutdown()
    h = sorted(soak.health)
    p99 = statistics.quantiles(h, n=100)[98] if len(h) >= 100 else h[-1]
    gap = max(soak.gaps, default=0.0)
    kv = info["metrics"]["kv_usage"]
    five = len(soak.five_xx)
    print(f"{elapsed:.0f} s, {len(soak.mix()) + 1} clients: {sum(soak.statuses.values())} responses "
          f"{dict(sorted(soak.statuses.items()))}; client-side errors {len(soak.client_errors)}")
    for line in soak.five_xx[:5] + soak.client_errors[:5]:
        print("  ", line)
    print(f"/health over {len(h)} polls: p50 {statistics.median(h) * 1e3:.1f} ms, p99 "
          f"{p99 * 1e3:.1f} ms, max {h[-1] * 1e3:.0f} ms")
    gaps = sorted(soak.gaps) or [0.0]
    print(f"well-behaved streams: {len(soak.gaps)} gaps between events, p99 "
          f"{gaps[int(0.99 * (len(gaps) - 1))] * 1e3:.0f} ms, max {gap * 1e3:.0f} ms")
    # the KV pool is paged in as first written: tokens the radix cache keeps add resident
    # pages by design (up to max_total_tokens x kv_bytes_per_token); growth is counted net of them
    cached_mb = (info["metrics"]["kv_cached_tokens"] - cached_start) \
        * info["kv_bytes_per_token"] / 2**20
    growth = (rss_end["total"] - cached_mb) / rss_start["total"] - 1
    print(f"RSS (server + children): {rss_start['total']:.0f} MB after warm-up, "
          f"{rss_end['total']:.0f} MB after ({(rss_end['total'] / rss_start['total'] - 1) * 100:+.1f}"
          f" %); by process: " + ", ".join(f"{k} {rss_start.get(k, 0):.0f} -> {v:.0f}"
                                           for k, v in rss_end.items() if k != "total"))
    print(f"  of which the KV of tokens the radix cache added: {cached_mb:.0f} MB; the rest "
          f"{growth * 100:+.1f} %")
    print(f"CPU over the run: server {cpu_run - cpu_start:.0f} s, client processes "
          f"{soak.client_cpu_s:.0f} s, of {os.cpu_count()} CPUs x {elapsed:.0f} s = "
          f"{(os.cpu_count() or 1) * elapsed:.0f} s")
    print(f"kv_usage idle {kv}, invariants {'ok' if info['invariants_ok'] else 'VIOLATED'}; "
          f"the radix cache held {cached_start} tokens after warm-up, "
          f"{info['metrics']['kv_cached_tokens']} after (their KV pages stay resident)")
    ok = (five == 0 and p99 < 0.1 and h[-1] < 1.0 and gap <= 1.0
          and growth <= 0.1 and kv == 0 and info["invariants_ok"])
    print("goals met" if ok else "goals MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
