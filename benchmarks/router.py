"""Data and tensor parallelism on this machine, side by side in one run.

    python -m benchmarks.router [--subjects 6] [--per-subject 16] [--in-flight 8] [--tp]

(a) MMLU 5-shot with the subjects interleaved (../shared/data/mmlu, 1 output token), sent over
    HTTP with ``--in-flight`` requests outstanding to: one server; ``--dp-size 2`` behind the
    cache-aware router; ``--dp-size 2`` behind round-robin. Reports programs/s and the cache
    hit rate (cached / prompt tokens, from the responses). Each replica gets its share of the
    cores (one of two here), so DP cannot beat one server on throughput on this machine; the
    point is the hit rate the routing keeps.
(b) ``--tp``: decode tok/s of the default model (fp32, dense) with TP=1 and TP=2 (gloo): 8
    prompts x 64 tokens.

GPU (when lent): ``python -m server --tp-size 2 --device cuda`` shards over two GPUs with NCCL;
``python -m benchmarks.router --tp`` measures it the same way.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import time

import httpx

from benchmarks.common import print_table, shared_data_dir
from benchmarks.prefix_cache import mmlu_prompts
from sgl_adapters.backends.runtime import Runtime


def interleave(items: list, subjects: int) -> list:
    per = len(items) // subjects
    return [items[s * per + i] for i in range(per) for s in range(subjects)]


def run_http(url: str, prompts: list[str], in_flight: int) -> tuple[float, float]:
    """(programs/s, hit rate) of 1-token /generate calls, ``in_flight`` at a time."""
    def one(p: str) -> dict:
        return httpx.post(url + "/generate", timeout=600, json={
            "text": p, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        outs = list(pool.map(one, prompts))
    elapsed = time.perf_counter() - start
    cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    total = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return len(prompts) / elapsed, cached / total


def tp_decode(tp: int) -> float:
    from server.engine import Engine

    eng = Engine(None, dtype="float32", quantization="none", context_length=512,
                 max_total_tokens=8192, tp_size=tp)
    try:
        prompts = [eng.apply_chat_template([{"role": "user", "content": f"Tell me about {t}."}])
                   for t in ("rivers", "stars", "bread", "music", "chess", "rain", "iron",
                             "salt")]
        sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
        eng.generate(prompts[:1], sampling_params={"max_new_tokens": 2})  # warm
        start = time.perf_counter()
        outs = eng.generate(prompts, sampling_params=sp)
        return sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - start)
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--subjects", type=int, default=6)
    ap.add_argument("--per-subject", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--tp", action="store_true", help="also measure TP=2 vs TP=1 decode")
    args = ap.parse_args()
    data = shared_data_dir()
    items = mmlu_prompts(os.path.join(data, "mmlu"), args.subjects, args.per_subject)
    prompts = interleave([p for p, _ in items], args.subjects)
    rows = []
    for label, extra in (("one server", []),
                         ("dp 2, cache-aware", ["--dp-size", "2"]),
                         ("dp 2, round-robin", ["--dp-size", "2", "--router-policy",
                                                "round_robin"])):
        with Runtime(None, extra_args=extra, log_level="warning") as rt:
            run_http(rt.base_url, prompts[:args.subjects], args.in_flight)  # warm-up
            httpx.post(rt.base_url + "/flush_cache")
            rate, hit = run_http(rt.base_url, prompts, args.in_flight)
        rows.append([label, str(len(prompts)), f"{rate:.2f}", f"{hit:.3f}"])
    print_table(["setup", "programs", "programs/s", "hit rate"], rows)
    if args.tp:
        one, two = tp_decode(1), tp_decode(2)
        print_table(["TP", "decode tok/s (8 x 64, fp32)"],
                    [["1", f"{one:.1f}"], ["2", f"{two:.1f}"], ["2 / 1", f"{two / one:.2f}"]])


if __name__ == "__main__":
    main()
