"""How much faster the DSPy program could run from the adapter side alone, measured.

    python -m benchmarks.adapter_ceiling [--n 40] [--k 3] [--ours URL] [--repeats 3]

An adapter (``SGLangLM``) cannot change the prompts DSPy formats (their new tokens must be
prefilled) or the fields' text (the model's, up to the caller's ``max_tokens``); it chooses
only the requests that carry them and any tokens decoded outside the fields' text (a marker a
free-text field stops on). Each repetition, on one server, measures all of it:

1. ``SGLangLM`` runs the main job's DSPy program (``examples/rag``, 16 in flight, an emptied
   prefix cache) and records every request its backend sends, per thread, with the
   ``/generate`` answers' ``meta_info``: T seconds;
2. the same requests are replayed on the cache they left, each cut to prefill only
   (``max_new_tokens`` 0), the per-thread order and concurrency kept: R seconds, the cost of
   the requests themselves (HTTP, tokenization, radix matching, scheduling; a ``select``'s
   prompt logprobs), with no new prompt token and no decoding. An upper bound on what fewer
   requests could save (one request a question would still pay part of it);
3. the marker tokens: the characters of every stop string a field ended on (a token holds at
   least one), at the marginal cost of a decoded token;
4. ``SGLangLM(max_tokens=1)`` (``benchmarks.programs``' ``dspy-floor``): every field cut to
   one token, F seconds, for the decoded tokens' marginal cost.

The adapter-side ceiling is T / (T - R - markers x cost a token), against the [5/8] goal of
1.3x; T / F, what removing every decoded token would give, is printed beside it (an adapter
must keep the fields' text, so that is not an adapter-side number). Server counters
(``/server_info``) around each phase give requests, new prompt tokens, generated tokens and
forward passes. The first line prints the CPU class.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.common import print_table
from benchmarks.programs import flush_prefix_cache, one_token_sglang_lm, question_args
from examples.rag.__main__ import evaluate
from examples.rag.data import load, mixed
from examples.rag.retrieval import Retriever
from kernels.cpu_features import cpu_description

COUNTERS = ("finished_requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens",
            "forward_passes")


class Recorder:
    """Every request an ``SGLangLM``'s backend sends, as (path, JSON body) lists per client
    thread in the order sent, and the ``meta_info`` of each ``/generate`` answer, through
    event hooks on the backend's httpx client (``lm.sglang_engine.backend``)."""

    def __init__(self, lm) -> None:
        self.calls: dict[int, list[tuple[str, dict]]] = defaultdict(list)
        self.metas: list[dict] = []
        self._lock = threading.Lock()
        lm.sglang_engine.backend._http.event_hooks = {"request": [self._request],
                                                      "response": [self._response]}

    def _request(self, request: httpx.Request) -> None:
        if request.method != "POST":  # the model info and chat template: read once
            return
        with self._lock:
            self.calls[threading.get_ident()].append((request.url.path,
                                                      json.loads(request.content)))

    def _response(self, response: httpx.Response) -> None:
        if response.request.url.path != "/generate" or response.status_code != 200:
            return
        response.read()
        outs = response.json()
        with self._lock:
            self.metas += [o["meta_info"] for o in (outs if isinstance(outs, list) else [outs])]

    def stop_chars(self) -> tuple[int, int]:
        """(fields that ended on a stop string, the characters of those strings)."""
        matched = [(m.get("finish_reason") or {}).get("matched") for m in self.metas]
        strings = [s for s in matched if isinstance(s, str)]
        return len(strings), sum(len(s) for s in strings)


def prefill_only(body: dict) -> dict:
    """``body`` with ``max_new_tokens`` 0 and no streaming: the request without its decoding."""
    sampling = {**body.get("sampling_params", {}), "max_new_tokens": 0}
    return {**{k: v for k, v in body.items() if k != "stream"}, "sampling_params": sampling}


def replay(base_url: str, calls: dict[int, list[tuple[str, dict]]]) -> float:
    """Send every recorded request again, prefill only, each thread's in its order and the
    threads side by side. Returns the wall seconds. Raises httpx.HTTPStatusError on a
    refused request."""
    with httpx.Client(base_url=base_url, timeout=600) as client:
        def run(seq):
            for path, body in seq:
                client.post(path, json=prefill_only(body)).raise_for_status()
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, len(calls))) as pool:
            list(pool.map(run, calls.values()))
        return time.perf_counter() - start


def counters(base_url: str) -> dict[str, float]:
    """The server's COUNTERS so far (``/server_info``). Raises httpx.HTTPError."""
    m = httpx.get(base_url + "/server_info", timeout=30).json()["metrics"]
    return {k: m[k] for k in COUNTERS}


def delta(after: dict, before: dict) -> dict:
    """COUNTERS gained between two ``counters`` readings."""
    return {k: after[k] - before[k] for k in COUNTERS}


def timed_program(url: str, questions, retriever, k: int, lm) -> tuple[float, dict]:
    """Seconds the main job's DSPy program took through ``lm`` (unrounded: a tiny row takes
    milliseconds) and the COUNTERS it added."""
    before, start = counters(url), time.perf_counter()
    evaluate("dspy", questions, retriever, k, url, grounded=False, lm=lm)
    return time.perf_counter() - start, delta(counters(url), before)


def repetition(url: str, questions, retriever, k: int) -> dict:
    """One repetition: SGLangLM recorded, its requests replayed prefill only, the floor."""
    from sgl_adapters.dspy import SGLangLM

    out = {}
    lm = SGLangLM(base_url=url, temperature=0.0, max_tokens=48, cache=False)
    recorder = Recorder(lm)
    flush_prefix_cache(url)
    out["dspy"] = timed_program(url, questions, retriever, k, lm)
    before = counters(url)
    out["replay"] = (replay(url, recorder.calls), delta(counters(url), before))
    flush_prefix_cache(url)
    out["floor"] = timed_program(url, questions, retriever, k, one_token_sglang_lm(url))
    out["stops"] = recorder.stop_chars()
    return out


def ceiling(rep: dict) -> tuple[float, float, float]:
    """(adapter-side ceiling T / (T - R - markers), T / F, seconds a decoded token)."""
    (t, a), (r, _), (f, b) = rep["dspy"], rep["replay"], rep["floor"]
    per_token = max(t - f, 0.0) / max(a["generated_tokens"] - b["generated_tokens"], 1)
    removable = r + rep["stops"][1] * per_token
    return t / max(t - removable, 1e-9), t / max(f, 1e-9), per_token


def main(argv: list[str] | None = None) -> None:
    ap = question_args(__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="questions run untimed first")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_description()}")
    passages, questions = load(args.data_dir)
    retriever = Retriever(passages)
    questions = mixed(questions, args.n + args.warmup)
    warm, questions = questions[args.n:], questions[:args.n]
    import sgl_adapters as sgl

    runtime = None if args.ours else sgl.Runtime(max_total_tokens=32768)
    url = (runtime.base_url if runtime else args.ours).rstrip("/")
    rows, lines = [], []
    try:
        if warm:
            evaluate("dspy", warm, retriever, args.k, url, grounded=False)
        for i in range(args.repeats):
            rep = repetition(url, questions, retriever, args.k)
            for name, label in (("dspy", "SGLangLM"), ("replay", "its requests, prefill only"),
                                ("floor", "SGLangLM(max_tokens=1)")):
                s, c = rep[name]
                rows.append([str(i + 1), label, f"{s:.2f}", f"{len(questions) / s:.2f}",
                             f"{c['finished_requests']:.0f}",
                             f"{c['prompt_tokens'] - c['cached_prompt_tokens']:.0f}",
                             f"{c['generated_tokens']:.0f}", f"{c['forward_passes']:.0f}"])
            bound, floor, per_token = ceiling(rep)
            lines.append(f"repetition {i + 1}: adapter-side ceiling {bound:.3f}x (goal 1.3x); "
                         f"fields ending on a stop string {rep['stops'][0]} "
                         f"({rep['stops'][1]} characters, {per_token * 1e3:.1f} ms a decoded "
                         f"token); every decoded token removed {floor:.2f}x")
    finally:
        if runtime is not None:
            runtime.shutdown()
    print_table(["rep", "row", "seconds", "q/s", "requests", "new prompt tokens", "generated",
                 "passes"], rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
