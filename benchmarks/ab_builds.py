"""One in-process workload alternated between two checkouts, for kernel changes worth a few
percent on a machine whose speed drifts by more than that between runs.

    python -m benchmarks.ab_builds DIR_A DIR_B [--rounds 10] [--chunked-prefill-size 1024]
                                   [--workload noshare|json|json-off]

Each checkout (its own ``kernels/cpu/_build``: ``python -m kernels.cpu.build`` run there first)
gets a worker process that loads the default model once and waits; each round then runs the
workload in A then B, B first on every other round:

- ``noshare`` (default): the peers' noshare prompts (``../shared/peers/workloads.json``: 32
  unrelated ~500-token prompts, 1 output token, a salt per prompt, the prefix cache emptied
  first) through ``Engine.generate``; prompt tokens/s.
- ``json`` / ``json-off``: ``benchmarks.json_decode``'s constrained JSON decoding of 23 cached
  city pages, 4 in flight, jump-forward on / off (n-gram drafts off); output tokens/s.

Prints the rate per round and the median of the per-round ratios B/A: pairs a minute apart
share the machine's phase, so the ratio holds where separate runs' medians would not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import REPO_ROOT

WORKLOADS = os.path.join(os.path.dirname(REPO_ROOT), "shared", "peers", "workloads.json")


def worker(workloads: str, chunked_prefill_size: int, workload: str) -> None:
    """Load the engine, print ``ready``, then time one pass over the prompts per stdin line."""
    from server.engine import Engine

    if workload != "noshare":
        json_worker(workload == "json")
        return
    with open(workloads) as f:
        noshare = json.load(f)["noshare"]
    engine = Engine(None, chunked_prefill_size=chunked_prefill_size)
    prompts = [engine.encode(f"[salt #{i}] " + p) for i, p in enumerate(noshare["prompts"])]
    engine.generate(input_ids=prompts[:4], sampling_params={"max_new_tokens": 1})  # warm-up
    tokens = sum(map(len, prompts))
    print("ready", flush=True)
    for _ in sys.stdin:
        engine.flush_cache()
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1})
        print(tokens / (time.perf_counter() - start), flush=True)


def json_worker(jump_forward: bool) -> None:
    """:func:`worker` for the constrained JSON workload: output tokens/s per round."""
    from benchmarks.common import run_in_flight
    from benchmarks.json_decode import city_prompts, json_params
    from server.engine import Engine

    engine = Engine(None, max_total_tokens=65536, speculative_ngram=0,
                    disable_jump_forward=not jump_forward)
    prompts = city_prompts(engine, 512)
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0})  # cache the pages
    params = json_params()
    run_in_flight(engine, prompts, params, 4)  # warm-up: the grammar's compile
    print("ready", flush=True)
    for _ in sys.stdin:
        reqs, seconds = run_in_flight(engine, prompts, params, 4)
        print(sum(len(r.output_ids) for r in reqs) / seconds, flush=True)


def start_worker(checkout: str, workloads: str, chunked_prefill_size: int,
                 workload: str) -> subprocess.Popen:
    """A worker running ``checkout``'s code (its PYTHONPATH and cwd; this file runs as a
    script, so the checkout need not have it), once it is ready. Raises RuntimeError if it
    exits first."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--workloads", workloads,
         "--chunked-prefill-size", str(chunked_prefill_size), "--workload", workload],
        cwd=checkout, env={**os.environ, "PYTHONPATH": os.path.abspath(checkout)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"the worker in {checkout} exited before it was ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs="*", help="DIR_A DIR_B")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--chunked-prefill-size", type=int, default=1024)
    ap.add_argument("--workloads", default=WORKLOADS, help="the peers' workloads.json")
    ap.add_argument("--workload", default="noshare", choices=["noshare", "json", "json-off"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.workloads, args.chunked_prefill_size, args.workload)
        return
    if len(args.checkouts) != 2:
        ap.error("give two checkouts, DIR_A DIR_B")
    workloads = os.path.abspath(args.workloads)
    workers = [start_worker(d, workloads, args.chunked_prefill_size, args.workload)
               for d in args.checkouts]
    rates: list[list[float]] = [[], []]
    try:
        for r in range(args.rounds):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                workers[i].stdin.write("go\n")
                workers[i].stdin.flush()
                rates[i].append(float(workers[i].stdout.readline()))
    finally:
        for w in workers:
            w.stdin.close()
            w.wait(timeout=60)
    ratios = [b / a for a, b in zip(*rates)]
    for d, x in zip(args.checkouts, rates):
        unit = "prompt" if args.workload == "noshare" else "output"
        print(f"{d}: median {statistics.median(x):.0f} {unit} tokens/s, rounds "
              + " ".join(f"{v:.0f}" for v in x))
    print("B/A per round: " + " ".join(f"{v:.3f}" for v in ratios)
          + f"; median {statistics.median(ratios):.4f}")


if __name__ == "__main__":
    main()
