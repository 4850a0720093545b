"""Operations routes: /health (the processes are up), /health_generate (a real 1-token generation,
or an embedding on an embedding-only model; 503 while the scheduler is down), /metrics
(Prometheus text), /model_info and /server_info (each also under its SGLang alias /get_...).
None of these needs the API key except /model_info and /server_info."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from server.http.errors import error_response
from server.http.responses import manager_of
from server.http.tokenizer_manager import GenerateInput
from server.model.files import reported_model_path
from server.sampling_params import SamplingParams

router = APIRouter()

_GAUGES = {  # scheduler metric -> help text
    "running_requests": "requests prefilling or decoding",
    "waiting_requests": "requests queued in the scheduler",
    "kv_usage": "share of the KV pool held by requests or locked cache entries",
    "kv_cached_tokens": "tokens held by the radix cache",
    "cache_hit_rate": "cached prompt tokens / prompt tokens since start",
    "host_tier_pages": "KV pages in the host tier (--hicache-size)",
    "disk_tier_pages": "KV pages in the disk tier (--cache-dir)",
}
_COUNTERS = {
    "prompt_tokens": "prompt tokens received", "cached_prompt_tokens": "prompt tokens reused",
    "generated_tokens": "tokens generated", "evicted_tokens": "cache tokens evicted",
    "tier_loaded_tokens": "cached tokens loaded back from the host or disk tier",
    "draft_tokens": "draft tokens (jump-forward, n-gram) verified",
    "accepted_draft_tokens": "draft tokens accepted by verification",
    "drafts_dropped": "drafts refused by the cost gate (their verify pass would not pay)",
    "retractions": "requests retracted under memory pressure", "aborts": "requests aborted",
    "invariant_violations": "KV memory invariant violations (should stay 0)",
}


class ServerMetrics:
    """Prometheus metrics of one app (its own registry, no process globals)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.gauges = {k: Gauge(f"sgl_{k}", h, registry=self.registry) for k, h in _GAUGES.items()}
        # Scheduler totals arrive as absolute values: expose them as gauges named *_total.
        self.totals = {k: Gauge(f"sgl_{k}_total", h, registry=self.registry)
                       for k, h in _COUNTERS.items()}
        self.client_aborts = Counter("sgl_client_aborts", "requests aborted by a disconnect",
                                     registry=self.registry)
        self.unbounded = Gauge("sgl_unbounded_requests_total", "requests that gave no "
                               "max_tokens (bounded only by the context length)",
                               registry=self.registry)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("sgl_time_to_first_token_seconds", "time to first token",
                              buckets=buckets, registry=self.registry)
        self.itl = Histogram("sgl_inter_token_latency_seconds", "time between streamed outputs",
                             buckets=buckets, registry=self.registry)
        self.e2e = Histogram("sgl_e2e_request_latency_seconds", "request latency, end to end",
                             buckets=buckets, registry=self.registry)

    def observe(self, event: str, seconds: float) -> None:
        """One latency sample (seconds) of ``event``: "ttft", "itl" or "e2e"."""
        if event == "ttft":
            self.ttft.observe(seconds)
        elif event == "itl":
            self.itl.observe(seconds)
        elif event == "e2e":
            self.e2e.observe(seconds)
        elif event == "abort":
            self.client_aborts.inc()


@router.get("/health")
async def health(request: Request):
    """200 while the scheduler process runs, else 503 (no model call)."""
    if not manager_of(request).scheduler_alive:
        return error_response(503, "the scheduler process is not running", "server_error")
    return {"status": "ok"}


@router.get("/health_generate")
async def health_generate(request: Request):
    """200 once a one-token generation (on an embedding-only model: an embedding) succeeds,
    else 503."""
    manager = manager_of(request)
    if not manager.scheduler_alive:
        return error_response(503, "the scheduler process is not running", "server_error")
    embed = manager.info.embedding_only
    inp = GenerateInput(manager.encode("ping"), SamplingParams(
        max_new_tokens=0 if embed else 1, temperature=0), embed=embed)
    async for out in manager.generate(inp):
        if out.finish_reason is not None and out.finish_reason.get("type") == "error":
            return error_response(503, "generation failed", "server_error")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    """Prometheus metrics: latency histograms, the scheduler's gauges and counters."""
    m: ServerMetrics = request.app.state.metrics
    manager = manager_of(request)
    m.unbounded.set(manager.unbounded_requests)
    if manager.scheduler_alive:
        info = await manager.server_info()
        for k, g in m.gauges.items():
            g.set(info.metrics[k])
        for k, g in m.totals.items():
            g.set(info.invariant_violations if k == "invariant_violations" else info.metrics[k])
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request):
    """The model and how it runs (path, dtype, device, attention backend, quantization,
    batch invariance, n-gram drafts), in SGLang's /get_model_info shape."""
    manager = manager_of(request)
    info, vision = manager.info, manager.vision
    path = request.app.state.model_path
    return {"model_path": reported_model_path(path) if path else None, "weights_path": path,
            "served_model_name": request.app.state.model_name, "context_len": info.context_len,
            "vocab_size": info.vocab_size, "dtype": info.dtype, "device": info.device,
            "kv_cache_dtype": info.kv_cache_dtype,
            "attention_backend": info.attention_backend, "quantization": info.quantization,
            "torch_compile": info.compiled, "batch_invariant": info.batch_invariant,
            "speculative_ngram": info.speculative_ngram, "is_generation": True,
            "is_multimodal": vision is not None,
            "image_token": vision.image_token if vision is not None else None,
            "tokens_per_image": vision.tokens_per_image if vision is not None else None,
            "chat_template": getattr(manager.tokenizer, "chat_template", None)}


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request):
    """The server's configuration and live state (requests in flight, KV use, metrics)."""
    manager = manager_of(request)
    info = await manager.server_info()
    now = time.monotonic()
    return {"max_total_tokens": manager.info.max_total_tokens,
            "kv_bytes_per_token": manager.info.kv_bytes_per_token, "metrics": info.metrics,
            "invariant_violations": info.invariant_violations,
            "invariants_ok": info.invariant_violations == 0,
            # the HTTP side's view: requests being served now, and how many ran unbounded
            "requests": [r.as_dict(now) for r in list(manager.in_flight.values())],
            "unbounded_requests": manager.unbounded_requests,
            **request.app.state.server_args}
