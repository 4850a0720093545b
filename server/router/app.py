"""The data-parallel router's HTTP app (:func:`create_router_app`): the routed paths passed
to :class:`server.router.router.Router`, stored responses found on their worker, health,
models, worker membership at run time, cache flushes and merged metrics. Handlers are small
functions that read the router from ``app.state``; errors are the server's OpenAI error objects
(:mod:`server.http.errors`).

HTTP comes from FastAPI/uvicorn and httpx; metrics from prometheus-client.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http.errors import error_response
from server.router.router import ROUTED_PATHS, Router, unavailable
from server.router.tree import PrefixTree


def _auth(request: Request) -> dict[str, str]:
    """The client's Authorization header, passed on to the workers as it came."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def _router(request: Request) -> Router:
    return request.app.state.router


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    """Check every worker once, poll their health while the app runs, close the client."""
    router: Router = app.state.router
    await asyncio.gather(*(router.check(w) for w in list(router.workers.values())))
    health = asyncio.get_running_loop().create_task(router.health_loop())
    yield
    health.cancel()
    await router.client.aclose()


def _routed(path: str):
    """The handler of one routed path: a JSON object body, forwarded by the policy."""
    async def route(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        return await _router(request).forward(path, body, _auth(request))
    return route


async def _stored_response(response_id: str, request: Request):
    """GET / DELETE /v1/responses/{id} on the worker that holds that response."""
    router = _router(request)
    worker = await router.owner(response_id, _auth(request))
    if worker is None:
        return error_response(404, f"response {response_id!r} not found on any worker",
                              "not_found_error")
    r = await router.client.request(request.method, f"{worker.url}/v1/responses/{response_id}",
                                    headers=_auth(request))
    return Response(r.content, r.status_code, media_type="application/json")


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    message = (f"route {request.method} {request.url.path} is not served by this router "
               f"(it routes {', '.join(ROUTED_PATHS)})" if exc.status_code == 404
               else str(exc.detail))
    return error_response(exc.status_code, message)


async def _health(request: Request):
    workers = _router(request).workers.values()
    if any(w.available for w in workers):
        return {"status": "ok", "workers": sum(w.healthy for w in workers)}
    return unavailable("no healthy worker")


async def _models(request: Request):
    """The first available worker's /v1/models (every worker serves the same model)."""
    router = _router(request)
    for w in router.workers.values():
        if w.available:
            r = await router.client.get(w.url + "/v1/models", headers=_auth(request))
            return Response(r.content, r.status_code, media_type="application/json")
    return unavailable("no healthy worker")


async def _list_workers(request: Request):
    return {"workers": [{"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight,
                         "tree_chars": w.tree.size, "capacity_tokens": w.capacity_tokens}
                        for w in _router(request).workers.values()]}


async def _add_worker(request: Request):
    try:
        body = await request.json()
    except ValueError:
        body = None
    url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return error_response(400, "give {'url': 'http://host:port'}", param="url")
    router = _router(request)
    await router.check(router.add(url))
    return {"added": url.rstrip("/")}


async def _remove_worker(url: str, request: Request):
    if not _router(request).remove(url):
        return error_response(404, f"no worker {url}", param="url")
    return {"removed": url.rstrip("/")}


async def _flush_cache(request: Request):
    """Every worker's /flush_cache, and the router's own prefix trees emptied."""
    router, results = _router(request), {}
    for w in list(router.workers.values()):
        try:
            results[w.url] = (await router.client.post(w.url + "/flush_cache")).status_code
        except httpx.HTTPError:
            results[w.url] = None
        w.tree = PrefixTree(w.tree.capacity)
    return {"flushed": results}


def _broadcast(path: str):
    """A handler posting the body to every worker's ``path`` (a LoRA adapter is loaded on all
    replicas): the first refusal's answer, else the last worker's."""
    async def handler(request: Request):
        router, body, answer = _router(request), await request.body(), None
        for w in list(router.workers.values()):
            try:
                answer = await router.client.post(w.url + path, content=body, timeout=120.0,
                                                  headers={**_auth(request),
                                                           "content-type": "application/json"})
            except httpx.HTTPError as exc:
                return error_response(502, f"worker {w.url}: {exc}", type="server_error")
            if answer.status_code >= 400:
                break
        if answer is None:
            return error_response(503, "no workers", type="server_error")
        return Response(answer.content, answer.status_code, media_type="application/json")

    return handler


async def _metrics(request: Request):
    """The router's metrics and every reachable worker's, labelled by worker."""
    router, families = _router(request), []
    for w in list(router.workers.values()):
        try:
            text = (await router.client.get(w.url + "/metrics", timeout=5.0)).text
        except httpx.HTTPError:
            continue
        for fam in text_string_to_metric_families(text):
            fam.samples = [s._replace(labels={**s.labels, "worker": w.url}) for s in fam.samples]
            families.append(fam)
    router.worker_metrics.families = _merge(families)
    return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)


def create_router_app(router: Router) -> FastAPI:
    """The FastAPI app of ``router`` (kept on ``app.state``; health polling starts with the
    app). Errors are the server's OpenAI error objects (:mod:`server.http.errors`)."""
    app = FastAPI(title="sgl-adapters router", lifespan=_lifespan)
    app.state.router = router
    for path in ROUTED_PATHS:
        app.post(path)(_routed(path))
    app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])(_stored_response)
    app.exception_handler(StarletteHTTPException)(_on_http_error)
    app.get("/health")(_health)
    app.get("/v1/models")(_models)
    app.get("/workers")(_list_workers)
    app.post("/workers")(_add_worker)
    app.delete("/workers")(_remove_worker)
    app.post("/flush_cache")(_flush_cache)
    for path in ("/load_lora_adapter", "/unload_lora_adapter"):
        app.post(path)(_broadcast(path))
    app.get("/metrics")(_metrics)
    return app


def _merge(families: list) -> list:
    """One family per metric name (the workers' samples together)."""
    merged: dict[str, Any] = {}
    for fam in families:
        if fam.name in merged:
            merged[fam.name].samples.extend(fam.samples)
        else:
            merged[fam.name] = fam
    return list(merged.values())
