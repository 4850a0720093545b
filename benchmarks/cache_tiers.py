"""KV tiers under the radix cache on the default model, side by side in one run.

    python -m benchmarks.cache_tiers [--subjects 8] [--per-subject 16] [--pool 4096]

(a) MMLU 5-shot with a pool too small for every subject's prefix: the subjects' questions
    arrive interleaved (round robin), 4 in flight, so each subject's 5-shot prefix is evicted
    between its uses. Tiers off vs a host tier (``hicache_size``) vs a disk tier only
    (``cache_dir``): hit rate, tokens loaded back from a tier, programs/s.
(b) Restart: a fresh engine with ``cache_dir`` runs one subject's questions and persists its
    cache (as a server does at shutdown); a new engine on the same directory runs them again.
    Prefill tokens computed and seconds of the second run vs a cold start (a new engine
    without the directory).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from benchmarks.common import print_table, run_in_flight, shared_data_dir
from benchmarks.prefix_cache import mmlu_prompts
from server.engine import Engine
from server.model.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=1, temperature=0)


def engine(pool: int, **kw) -> Engine:
    eng = Engine(max_total_tokens=pool, max_new_tokens_reserve=1, **kw)
    eng.generate([f"warm-up {i} " * 60 for i in range(2)], {"max_new_tokens": 2})
    eng.flush_cache()
    eng.scheduler.reset_stats()
    return eng


def run(eng: Engine, prompts: list[list[int]], in_flight: int) -> dict[str, float]:
    before = eng.cache.stats.loaded_tokens
    reqs, seconds = run_in_flight(eng, prompts, PARAMS, in_flight)
    st = eng.scheduler.stats
    return {"seconds": seconds, "programs/s": len(prompts) / seconds,
            "hit": st.cache_hit_rate, "computed": st.prompt_tokens - st.cached_prompt_tokens,
            "loaded": eng.cache.stats.loaded_tokens - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--subjects", type=int, default=8)
    ap.add_argument("--per-subject", type=int, default=16)
    ap.add_argument("--pool", type=int, default=4096, help="KV pool tokens (too small)")
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--restart-only", action="store_true", help="run (b) only")
    args = ap.parse_args()
    data = shared_data_dir()
    if data is None:
        raise SystemExit("needs ../shared/data (MMLU) next to the repository")
    items = mmlu_prompts(os.path.join(data, "mmlu"), args.subjects, args.per_subject)
    by_subject = [items[i * args.per_subject:(i + 1) * args.per_subject]
                  for i in range(args.subjects)]
    interleaved = [s[j] for j in range(args.per_subject) for s in by_subject]
    tmp = tempfile.mkdtemp(prefix="sgl-tiers-")

    off = engine(args.pool)
    prompts = [off.encode(p) for p, _ in interleaved]
    print(f"(a) MMLU 5-shot, {args.subjects} subjects x {args.per_subject} questions "
          f"interleaved, mean {sum(map(len, prompts)) / len(prompts):.0f} tokens, pool "
          f"{args.pool} tokens, {args.in_flight} in flight, dtype {off.config.model.dtype}")
    rows = []
    for label, eng in () if args.restart_only else (("tiers off", off),
                       ("host tier (1 GB)", engine(args.pool, hicache_size=1.0)),
                       ("disk tier only", engine(args.pool,
                                                 cache_dir=os.path.join(tmp, "a")))):
        r = run(eng, prompts, args.in_flight)
        rows.append([label, f"{r['hit']:.3f}", str(r["loaded"]), str(r["computed"]),
                     f"{r['seconds']:.1f}", f"{r['programs/s']:.2f}"])
        del eng
    if rows:
            print_table(["tiers", "hit rate", "tokens loaded back", "prefill tokens computed",
                     "seconds", "programs/s"], rows)

    # the subject with the longest 5-shot prefix
    subject = max(([off.encode(p) for p, _ in s] for s in by_subject), key=lambda s: len(s[0]))
    del off
    print(f"\n(b) restart: {len(subject)} questions of one subject ({len(subject[0])} tokens "
          f"each), {args.in_flight} in flight")
    cache_dir = os.path.join(tmp, "b")
    first = engine(65536, cache_dir=cache_dir)
    r1 = run(first, subject, args.in_flight)
    start = time.perf_counter()
    first.cache.persist()
    persist_s = time.perf_counter() - start
    del first
    warm = engine(65536, cache_dir=cache_dir)
    r2 = run(warm, subject, args.in_flight)
    del warm
    cold = engine(65536)
    r3 = run(cold, subject, args.in_flight)
    print_table(["run", "prefill tokens computed", "tokens loaded from disk", "seconds"], [
        ["first run (cold, then persisted in %.2f s)" % persist_s, str(r1["computed"]), "0",
         f"{r1['seconds']:.1f}"],
        ["after a restart, same --cache-dir", str(r2["computed"]), str(r2["loaded"]),
         f"{r2['seconds']:.1f}"],
        ["after a restart, no --cache-dir (cold)", str(r3["computed"]), "0",
         f"{r3['seconds']:.1f}"]])


if __name__ == "__main__":
    main()
