"""The paper's workloads (benchmarks/workloads.py), each as a language program, on our server and
on the OpenAI-style path, in one run; one table and one JSONL row per (workload, config).

    python -m benchmarks.all                      # three configs, two bundled servers, ~10 min
    python -m benchmarks.all --backend sgl --base-url http://127.0.0.1:30000
    python -m benchmarks.all --backend openai --base-url http://HOST:PORT/v1 [--model NAME]
    options: --workloads mmlu,hellaswag  --scale 2  --threads 8  --out benchmark_results.jsonl

Configs of the default run (same machine, same run, same prompts):
* ``sgl``: the native backend against our server with its radix cache (fork and batch prefix
  hints, select = one prefill + one batched scoring request);
* ``sgl-nocache``: the same against a server started with ``--disable-radix-cache``;
* ``openai``: the :class:`sgl_adapters.OpenAI` backend in completion mode (the server's chat
  template renders roles, so the text is the same) against the no-cache server: one request per
  call, select scores the choices with one prompt-logprob (echo) request, as the paper's
  baselines did.

Columns: programs, seconds, programs/s, accuracy (where the workload defines one: see each
workload's score), the server's cache hit rate (cached / prompt tokens over the workload, from
``/server_info``), and the optimal hit rate for the requests this run actually sent (SGLang
paper Theorem 3.1: every radix-tree edge computed once; :func:`benchmarks.common.optimal_hit_rate`).
Each workload starts with a flushed cache.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import httpx

import sgl_adapters as sgl
from benchmarks.common import optimal_hit_rate, print_table
from benchmarks.workloads import WORKLOADS, Workload

# Programs per workload at --scale 1: about 10 minutes for the three configs on 2 CPU cores.
SIZES = {"mmlu": 24, "hellaswag": 12, "react": 4, "tree_of_thought": 2, "essay_judge": 3,
         "json_decode": 6, "multi_turn_short": 8, "multi_turn_long": 4, "dspy_rag": 16}
HEADER = ["workload", "config", "programs", "seconds", "programs/s", "accuracy",
          "cache hit rate", "optimal hit rate"]


class RecordingBackend:
    """Wraps a backend and records the prompt texts it sends, for the optimal hit rate. For
    the native backend a select also prefills the bare prompt; a cache hint is a request."""

    def __init__(self, inner: Any, prefills_select_prompt: bool):
        self.inner, self._bare = inner, prefills_select_prompt
        self.texts: list[str] = []
        self.outputs: list[tuple[str, str]] = []  # (prompt, generated text)
        self._lock = threading.Lock()

    def _record(self, *texts: str) -> None:
        with self._lock:
            self.texts += texts

    def _output(self, prompt: str, result):
        with self._lock:
            self.outputs.append((prompt, result.text))
        return result

    def optimal_hit_rate(self, tokenizer) -> float | None:
        if not self.texts or tokenizer is None:
            return None
        return optimal_hit_rate([tokenizer.encode(t) for t in self.texts],
                                [(tokenizer.encode(p), tokenizer.encode(p + o))
                                 for p, o in self.outputs])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def generate(self, call):
        self._record(call.text)
        return self._output(call.text, self.inner.generate(call))

    def generate_stream(self, call):
        self._record(call.text)
        for piece in self.inner.generate_stream(call):
            yield piece if isinstance(piece, str) else self._output(call.text, piece)

    def select(self, call, choices, method, temperature=0.0):
        self._record(*([call.text] if self._bare else []), *(call.text + c for c in choices))
        return self.inner.select(call, choices, method, temperature)

    def cache_prefix(self, text: str) -> None:
        if self._bare and text:
            self._record(text)
        self.inner.cache_prefix(text)


class Target:
    """One config: a backend kind and the server it talks to (``root``: the server's own URL,
    for ``/server_info`` and ``/flush_cache`` where the server has them)."""

    def __init__(self, label: str, kind: str, base_url: str, model: str | None = None):
        self.label, self.kind, self.base_url = label, kind, base_url.rstrip("/")
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.model = model

    def backend(self) -> RecordingBackend:
        if self.kind == "sgl":
            return RecordingBackend(sgl.RuntimeEndpoint(self.root), True)
        try:  # the server's own chat template keeps the prompts byte-identical to `sgl`
            native = sgl.RuntimeEndpoint(self.root)
            template = native.chat_template
            native.shutdown()
        except Exception:
            print(f"note: {self.root} has no /get_model_info; roles are rendered as plain text")
            template = None
        model = self.model or sgl.OpenAI("-", self.base_url).client.models.list().data[0].id
        return RecordingBackend(sgl.OpenAI(model, self.base_url, is_chat_model=False,
                                           chat_template=template), False)

    def tokenizer(self):
        """The served model's tokenizer when its files are on this machine (the bundled
        servers), for the optimal hit rate; None otherwise (the column then shows "-")."""
        try:
            path = httpx.get(self.root + "/get_model_info", timeout=30).json()["model_path"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        if not path or not os.path.exists(path):
            return None
        from server.model.loader import load_model

        return load_model(path).tokenizer

    def counters(self) -> tuple[int, int] | None:
        try:
            m = httpx.get(self.root + "/server_info", timeout=30).json()["metrics"]
            return m["prompt_tokens"], m["cached_prompt_tokens"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None

    def flush(self) -> None:
        try:
            httpx.post(self.root + "/flush_cache", json={}, timeout=60)
        except httpx.HTTPError:
            pass


def run_workload(w: Workload, target: Target, threads: int, tokenizer) -> dict[str, Any]:
    """Run one workload on one config; the result row as a dict."""
    target.flush()
    before = target.counters()
    backend = None
    start = time.perf_counter()
    if w.run is not None:
        outputs = w.run(target.kind, target.root if target.kind == "sgl" else target.base_url,
                        threads)
    else:
        backend = target.backend()
        outputs = w.program.run_batch(w.args, num_threads=threads, progress_bar=False,
                                      backend=backend)
    seconds = time.perf_counter() - start
    after = target.counters()
    errors = [s.error() for s in outputs if hasattr(s, "error") and s.error() is not None]
    if errors:
        print(f"{w.name} on {target.label}: {len(errors)} programs failed, first: {errors[0]!r}")
    hit = optimal = None
    if before and after and after[0] > before[0]:
        hit = (after[1] - before[1]) / (after[0] - before[0])
    if backend is not None:
        optimal = backend.optimal_hit_rate(tokenizer)
        backend.inner.shutdown()
    return {"workload": w.name, "config": target.label, "programs": len(w.args),
            "seconds": round(seconds, 2), "programs_per_s": round(len(w.args) / seconds, 3),
            "accuracy": _round(w.score(outputs, w.args)), "cache_hit_rate": _round(hit),
            "optimal_hit_rate": _round(optimal), "errors": len(errors)}


def summary(rows: list[dict], labels: list[str]) -> tuple[list[str], list[list[str]]]:
    """One line per workload: programs/s per config, the first config's speed-up over the last,
    and the first config's hit rate next to the optimal."""
    header = ["workload", *(f"{x} programs/s" for x in labels), f"{labels[0]} / {labels[-1]}",
              f"{labels[0]} hit rate", "optimal"]
    out = []
    for name in dict.fromkeys(r["workload"] for r in rows):
        by = {r["config"]: r for r in rows if r["workload"] == name}
        if not all(x in by for x in labels):
            continue
        first, last = by[labels[0]], by[labels[-1]]
        out.append([name, *(str(by[x]["programs_per_s"]) for x in labels),
                    f"{first['programs_per_s'] / last['programs_per_s']:.2f}x",
                    _cell(first["cache_hit_rate"]), _cell(first["optimal_hit_rate"])])
    return header, out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _cell(x: Any) -> str:
    return "-" if x is None else str(x)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sgl", "openai"],
                    help="one config; default: sgl, sgl-nocache and openai side by side")
    ap.add_argument("--base-url", help="an existing server (native root, or .../v1 for openai)")
    ap.add_argument("--model", help="model name for --backend openai (default: the first listed)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the programs per workload")
    ap.add_argument("--threads", type=int, default=8, help="programs in flight")
    ap.add_argument("--out", default="benchmark_results.jsonl")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    workloads = [WORKLOADS[n](max(1, round(SIZES[n] * args.scale))) for n in names]

    runtimes: list[sgl.Runtime] = []
    try:
        if args.base_url:
            targets = [Target(args.backend or "sgl", args.backend or "sgl", args.base_url,
                              args.model)]
        else:
            print("starting the bundled servers (default model) ...", flush=True)
            cached = sgl.Runtime(max_total_tokens=65536)
            runtimes.append(cached)
            targets = []
            if args.backend in (None, "sgl"):
                targets.append(Target("sgl", "sgl", cached.base_url))
            if args.backend in (None, "openai"):
                plain = sgl.Runtime(max_total_tokens=65536, disable_radix_cache=True)
                runtimes.append(plain)
                if args.backend is None:
                    targets.append(Target("sgl-nocache", "sgl", plain.base_url))
                targets.append(Target("openai", "openai", plain.base_url + "/v1"))
        rows = []
        tokenizers = {t.label: t.tokenizer() for t in targets}
        with open(args.out, "a") as out:
            for w in workloads:
                for t in targets:
                    row = run_workload(w, t, args.threads, tokenizers[t.label])
                    print(" | ".join(_cell(row[k]) for k in row), flush=True)
                    out.write(json.dumps({**row, "time": time.time(), "threads": args.threads})
                              + "\n")
                    rows.append(row)
    finally:
        for rt in runtimes:
            rt.shutdown()
    print()
    print_table(HEADER, [[_cell(r[k]) for k in ("workload", "config", "programs", "seconds",
                                                "programs_per_s", "accuracy", "cache_hit_rate",
                                                "optimal_hit_rate")] for r in rows])
    if len(targets) > 1:
        print()
        print_table(*summary(rows, [t.label for t in targets]))
    print(f"\nrows appended to {args.out}")


if __name__ == "__main__":
    main()
