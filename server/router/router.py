"""The data-parallel router: one HTTP front for several servers (workers), passing the native
and OpenAI APIs through (streams included) to the worker a policy picks
(:mod:`server.router.policy`).

* Health: every ``health_interval`` seconds each worker's ``/health`` is polled; a worker that
  fails it, refuses a connection or breaks a stream is taken out until it answers again.
* Failover: a request whose worker cannot be reached, or answers 503 (overloaded, draining),
  goes to another worker before any byte of the response is sent; a 503 also backs the worker
  off for its ``Retry-After``. A stream that breaks after it started ends with an SSE error
  event and ``[DONE]`` (the client knows; nothing is replayed).
* Responses API: a worker keeps the responses it produced (``previous_response_id``), so a
  request chained to one, and ``GET`` / ``DELETE /v1/responses/{id}``, go to the worker that
  answers ``GET /v1/responses/{id}`` (all are asked at once; no router state to lose).
* Workers can be listed, added and removed at run time (``GET/POST/DELETE /workers``), and
  ``/metrics`` merges every worker's Prometheus metrics under a ``worker`` label with the
  router's own.

Its HTTP app is :mod:`server.router.app`; requests go out with httpx, metrics through
prometheus-client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from server.http.errors import error_body, error_response
from server.router.policy import WorkerState, make_policy
from server.router.tree import PrefixTree

log = logging.getLogger("server.router")
ROUTED_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
                "/v1/embeddings", "/encode", "/v1/rerank", "/rerank", "/score")
DEFAULT_CAPACITY_TOKENS = 65536


@dataclass
class Worker(WorkerState):
    """A server behind the router: its health (polled; a broken connection or stream takes it
    out), its 503 back-off and its KV capacity in tokens (from its /server_info), which sizes
    its prefix tree."""

    healthy: bool = True
    backoff_until: float = 0.0  # time.monotonic() before which a 503-ing worker is skipped
    capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    extra: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Healthy and not backing off a 503: the policy may pick it."""
        return self.healthy and time.monotonic() >= self.backoff_until


def request_key(path: str, body: dict[str, Any]) -> str:
    """The text a request's prefix is matched on: the prompt, or the chat rendered in order
    (roles and contents; tools first), or token ids written out."""
    if path == "/v1/chat/completions":
        parts = [json.dumps(body.get("tools"), sort_keys=True)] if body.get("tools") else []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role') if isinstance(m, dict) else ''}>{content or ''}")
        return "\n".join(parts)
    if path == "/v1/responses":
        items = body.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        messages = [{"role": "system", "content": body.get("instructions")}] \
            if body.get("instructions") else []
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and "role" in item:
                content = item.get("content")
                if isinstance(content, list):
                    content = [{"text": p.get("text")} for p in content if isinstance(p, dict)]
                messages.append({"role": item["role"], "content": content})
        return request_key("/v1/chat/completions", {"messages": messages})
    if path in ("/v1/rerank", "/rerank", "/score"):  # the query: its prefix is shared
        return request_key("/v1/completions", {"prompt": body.get(
            "text_1" if path == "/score" else "query")})
    native = path in ("/generate", "/encode")
    prompt = body.get("text") if native else body.get(
        "input" if path == "/v1/embeddings" else "prompt")
    if prompt is None and native:
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch goes where its first prompt goes
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt) + ","
    return prompt if isinstance(prompt, str) else ""


class Router:
    """Args: worker_urls; policy ("cache_aware", "round_robin", "least_load");
    chars_per_token: how a worker's KV capacity (tokens) becomes its tree's (characters);
    health_interval: seconds between health polls; timeout: seconds a worker may take to
    answer (streams: between chunks); parent_pid: stop once that process is gone."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware",
                 chars_per_token: float = 4.0, health_interval: float = 2.0,
                 timeout: float = 600.0, parent_pid: int | None = None):
        self.parent_pid = parent_pid
        self.policy = make_policy(policy)
        self.chars_per_token = chars_per_token
        self.health_interval = health_interval
        self.workers: dict[str, Worker] = {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0))
        self.registry = CollectorRegistry()
        self.routed = Counter("router_requests", "requests sent to each worker", ["worker"],
                              registry=self.registry)
        self.failovers = Counter("router_failovers", "requests moved to another worker "
                                 "before their response started", registry=self.registry)
        self.worker_metrics = _WorkerMetrics()
        self.registry.register(self.worker_metrics)
        for url in worker_urls:
            self.add(url)

    # ---------------------------------------------------------------- membership
    def add(self, url: str) -> Worker:
        """The worker at ``url``, added (healthy until its first check) if it is new."""
        url = url.rstrip("/")
        if url not in self.workers:
            self.workers[url] = Worker(url, PrefixTree(self._capacity(DEFAULT_CAPACITY_TOKENS)))
        return self.workers[url]

    def remove(self, url: str) -> bool:
        """Stop routing to ``url``; False when it was not a worker. Its requests in flight
        finish."""
        return self.workers.pop(url.rstrip("/"), None) is not None

    def _capacity(self, tokens: int) -> int:
        return int(tokens * self.chars_per_token)

    # ---------------------------------------------------------------- health
    async def check(self, worker: Worker) -> None:
        """Poll ``worker``'s /health (5 s), and its /server_info once for its KV capacity; a
        failure takes it out until a later check passes."""
        try:
            ok = (await self.client.get(worker.url + "/health", timeout=5.0)).status_code == 200
            if ok and worker.capacity_tokens == DEFAULT_CAPACITY_TOKENS:
                info = (await self.client.get(worker.url + "/server_info", timeout=5.0)).json()
                worker.capacity_tokens = int(info.get("max_total_tokens")
                                             or DEFAULT_CAPACITY_TOKENS)
                worker.tree.capacity = self._capacity(worker.capacity_tokens)
        except (httpx.HTTPError, ValueError):
            ok = False
        if ok != worker.healthy:
            log.warning("worker %s is %s", worker.url, "back" if ok else "out (health check)")
        worker.healthy = ok

    async def health_loop(self) -> None:
        """Check every worker each ``health_interval`` seconds; SIGTERM this process once the
        process that started it (``parent_pid``) is gone."""
        while True:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                log.error("the process that started the router is gone; shutting down")
                os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown
                return
            await asyncio.gather(*(self.check(w) for w in list(self.workers.values())))
            await asyncio.sleep(self.health_interval)

    # ---------------------------------------------------------------- routing
    async def owner(self, response_id: str, headers: dict[str, str]) -> Worker | None:
        """The worker holding stored response ``response_id`` (each available worker is asked
        ``GET /v1/responses/{id}`` at once), or None."""
        async def holds(w: Worker) -> bool:
            try:
                r = await self.client.get(f"{w.url}/v1/responses/{response_id}",
                                          headers=headers, timeout=5.0)
                return r.status_code == 200
            except httpx.HTTPError:
                return False
        workers = [w for w in self.workers.values() if w.available]
        found = await asyncio.gather(*(holds(w) for w in workers))
        return next((w for w, ok in zip(workers, found) if ok), None)

    def pick(self, key: str, exclude: set[str], only: Worker | None = None) -> Worker | None:
        """The available worker the policy picks for request text ``key`` (never one in
        ``exclude``; only ``only`` when given), its tree then holding ``key``; None if none."""
        candidates = [w for w in self.workers.values() if w.available and w.url not in exclude
                      and (only is None or w is only)]
        if not candidates:
            return None
        worker = self.policy.pick(candidates, key)
        worker.tree.insert(key)
        return worker

    async def forward(self, path: str, body: dict[str, Any], headers: dict[str, str]):
        """Send the request to a worker (failing over before the response starts); returns
        the FastAPI response."""
        key = request_key(path, body)
        tried: set[str] = set()
        stream = bool(body.get("stream"))
        previous = body.get("previous_response_id") if path == "/v1/responses" else None
        pinned = await self.owner(previous, headers) if isinstance(previous, str) else None
        while True:
            worker = self.pick(key, tried, pinned)
            if worker is None:
                return unavailable("no worker is available" + (f" (tried {len(tried)})"
                                                               if tried else ""))
            tried.add(worker.url)
            self.routed.labels(worker.url).inc()
            worker.in_flight += 1
            try:
                req = self.client.build_request("POST", worker.url + path, json=body,
                                                headers=headers)
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as exc:
                worker.in_flight -= 1
                worker.healthy = False
                log.warning("worker %s unreachable (%s); taken out", worker.url, exc)
                self.failovers.inc()
                continue
            if resp.status_code == 503:
                retry = float(resp.headers.get("retry-after") or 1)
                worker.backoff_until = time.monotonic() + retry
                await resp.aclose()
                worker.in_flight -= 1
                self.failovers.inc()
                continue
            if stream and resp.status_code == 200:
                return StreamingResponse(self._relay(worker, resp), status_code=200,
                                         media_type=resp.headers.get("content-type"))
            try:
                content = await resp.aread()
            except httpx.HTTPError as exc:  # nothing reached the client yet: fail over
                worker.healthy = False
                log.warning("worker %s failed mid-response (%s); taken out", worker.url, exc)
                self.failovers.inc()
                continue
            finally:
                await resp.aclose()
                worker.in_flight -= 1
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"))

    async def _relay(self, worker: Worker, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            worker.healthy = False
            log.warning("worker %s broke a stream (%s); taken out", worker.url, exc)
            err = error_body(503, f"the worker serving this stream failed: {exc}",
                             "server_error")
            yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            worker.in_flight -= 1


class _WorkerMetrics:
    """prometheus-client collector: the workers' last scraped metrics, with a worker label."""

    def __init__(self) -> None:
        self.families: list = []

    def collect(self):
        return iter(self.families)


def unavailable(message: str) -> JSONResponse:
    """503 with a short Retry-After: no worker can take the request now."""
    return error_response(503, message, "server_error", headers={"Retry-After": "1"})
