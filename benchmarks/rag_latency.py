"""Question latency of the main job's sgl pipeline under concurrency: mixed chunks on vs off.

    python -m benchmarks.rag_latency [--n 40] [--threads 16] [--configs mixed,prefill-first]
        [--configs overloaded,overloaded-fcfs]

Each question is one program of ``examples.rag.pipelines.run_sgl`` (a prefix, three forked
24-token notes, then a grounded answer or a yes/no select: ~6 requests in three phases), run
on its own thread, ``--threads`` at once (the first wave starts together, later questions start
as threads free up), greedy, against one server per config started fresh (same questions, same
order). Reports the time to the first finished question, p50/p90/max question latency (its
program's wall time), the first wave's p50 and the total wall time.

``overloaded`` / ``overloaded-fcfs``: at most 4 requests run at once, so calls wait; the
interpreter sends each call's position in its program as its priority, and the server admits
a program's later calls before new programs' first calls (or, with
``--disable-priority-scheduling``, in the policy's order): programs finish sooner.

Why: with prefill-first batching a steady stream of prompts (other programs' calls) holds running
requests back: in a trace of 40 questions, 24-token notes admitted at once took 16-19 s to
decode. Mixed chunks (the default) decode them in every extend pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.common import print_table
from examples.rag import pipelines
from examples.rag.data import load, mixed
from examples.rag.retrieval import Retriever

CONFIGS = {"mixed": {}, "prefill-first": {"disable_mixed_chunk": True},
           # more calls in flight than the server runs at once: the waiting queue's order
           # decides (a program's later calls first, or arrival order)
           "overloaded": {"max_running_requests": 4},
           "overloaded-fcfs": {"max_running_requests": 4, "disable_priority_scheduling": True}}


def run(config: dict, questions, retriever: Retriever, threads: int) -> dict[str, float]:
    import sgl_adapters as sgl

    rt = sgl.Runtime(max_total_tokens=32768, **config)
    try:
        start = time.perf_counter()

        def one(q) -> tuple[float, float]:
            t0 = time.perf_counter()
            pipelines.run_sgl([q], retriever, 3, rt.base_url, threads=1)
            end = time.perf_counter()
            return end - start, end - t0

        with ThreadPoolExecutor(threads) as pool:
            results = list(pool.map(one, questions))
        total = time.perf_counter() - start
        info = httpx.get(rt.base_url + "/server_info", timeout=10).json()
    finally:
        rt.shutdown()
    lat = sorted(r[1] for r in results)
    return {"first": min(r[0] for r in results), "p50": statistics.median(lat),
            "p90": lat[max(0, int(0.9 * len(lat)) - 1)], "max": lat[-1],
            "wave1": statistics.median(r[1] for r in results[:threads]), "total": total,
            "hit": info["metrics"]["cache_hit_rate"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40, help="questions (span and yes/no mixed)")
    ap.add_argument("--threads", type=int, default=16, help="questions in flight")
    ap.add_argument("--configs", default="mixed,prefill-first")
    args = ap.parse_args()
    passages, all_questions = load(None)
    retriever = Retriever(passages)
    questions = mixed(all_questions, args.n)
    rows = []
    for name in args.configs.split(","):
        r = run(CONFIGS[name], questions, retriever, args.threads)
        rows.append([name, f"{r['first']:.1f}", f"{r['p50']:.1f}", f"{r['p90']:.1f}",
                     f"{r['max']:.1f}", f"{r['wave1']:.1f}", f"{r['total']:.1f}",
                     f"{r['hit']:.3f}"])
    print(f"{args.n} questions, {args.threads} in flight (seconds):")
    print_table(["config", "first finished", "p50", "p90", "max", "first-wave p50", "total",
                 "hit rate"], rows)


if __name__ == "__main__":
    main()
