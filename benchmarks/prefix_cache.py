"""Prefix caching on the default model, side by side in one run.

    python -m benchmarks.prefix_cache [--subjects 3] [--per-subject 64] [--in-flight 16]

(a) MMLU 5-shot (../shared/data/mmlu; the classic "The following are multiple choice questions
    (with answers) about ..." prompt, 1 output token): programs/s with the radix cache on (lpm,
    fcfs) and off, accuracy, and the cache hit rate next to the optimal hit rate for that batch
    (SGLang paper Theorem 3.1). Clients keep ``--in-flight`` requests outstanding.
(b) No shared prefixes (32 unrelated ~500-token Wikipedia passages, 1 output token, 8 in flight):
    throughput with the cache on vs off, alternating the two engines A/B/A/B... to cancel drift
    on a noisy machine; reports the median of the repeats and the overhead.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import statistics

from benchmarks.common import optimal_hit_rate, print_table, run_in_flight, shared_data_dir
from server.engine import Engine
from server.model.sampling import SamplingParams

CHOICES = "ABCD"


def format_example(row: list[str], with_answer: bool) -> str:
    text = row[0] + "".join(f"\n{c}. {row[i + 1]}" for i, c in enumerate(CHOICES)) + "\nAnswer:"
    return text + (f" {row[5]}\n\n" if with_answer else "")


def mmlu_prompts(data: str, subjects: int, per_subject: int,
                 names: list[str] | None = None) -> list[tuple[str, str]]:
    """(prompt, gold letter) pairs, subject-major (clients send one subject after another).
    ``names`` picks subjects; else ``subjects`` of them spread over the alphabet."""
    all_names = sorted(f[:-len("_dev.csv")] for f in os.listdir(os.path.join(data, "dev")))
    picked = names or [all_names[i * len(all_names) // subjects] for i in range(subjects)]
    out = []
    for subject in picked:
        with open(os.path.join(data, "dev", f"{subject}_dev.csv"), newline="") as f:
            shots = list(csv.reader(f))[:5]
        with open(os.path.join(data, "test", f"{subject}_test.csv"), newline="") as f:
            tests = list(csv.reader(f))[:per_subject]
        head = (f"The following are multiple choice questions (with answers) about "
                f"{subject.replace('_', ' ')}.\n\n"
                + "".join(format_example(r, True) for r in shots))
        out += [(head + format_example(r, False), r[5]) for r in tests]
    return out


def mmlu_row(engine: Engine, label: str, prompts, golds, in_flight: int) -> list[str]:
    params = SamplingParams(max_new_tokens=1, temperature=0)
    reqs, elapsed = run_in_flight(engine, prompts, params, in_flight)
    answers = [engine.tokenizer.decode(r.output_ids).strip() for r in reqs]
    acc = sum(a == g for a, g in zip(answers, golds)) / len(golds)
    stats = engine.scheduler.stats
    opt = optimal_hit_rate(prompts)
    hit = stats.cache_hit_rate
    return [label, str(len(prompts)), f"{elapsed:.1f}", f"{len(prompts) / elapsed:.2f}",
            f"{acc:.3f}", f"{hit:.3f}", f"{opt:.3f}", f"{hit / opt:.3f}" if opt else "-"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--subjects", type=int, default=3)
    ap.add_argument("--per-subject", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--subject-names", default=None,
                    help="comma-separated MMLU subjects (e.g. security_studies: a ~1,000-token "
                         "5-shot prefix, as in DESIGN.md's reference row)")
    ap.add_argument("--repeats", type=int, default=3, help="A/B repeats for workload (b)")
    ap.add_argument("--skip-no-share", action="store_true", help="run workload (a) only")
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto")
    ap.add_argument("--attention-backend", default="auto",
                    help="auto, reference, triton or flashinfer")
    args = ap.parse_args()
    data = shared_data_dir()
    if data is None:
        raise SystemExit("needs ../shared/data (MMLU and wiki_rag) next to the repository")

    def engine(**kw) -> Engine:
        """A fresh engine, warmed up (first bf16 matmuls of each shape are slow), stats zeroed."""
        eng = Engine(args.model, max_total_tokens=65536, device=args.device,
                     attention_backend=args.attention_backend, **kw)
        eng.generate([f"warm-up {i} " * 60 for i in range(4)], {"max_new_tokens": 2})
        eng.flush_cache()
        eng.scheduler.reset_stats()
        return eng

    base = engine()
    names = args.subject_names.split(",") if args.subject_names else None
    items = mmlu_prompts(os.path.join(data, "mmlu"), args.subjects, args.per_subject, names)
    prompts = [base.encode(p) for p, _ in items]
    golds = [g for _, g in items]
    print(f"(a) MMLU 5-shot: {len(prompts)} prompts, {len(names or range(args.subjects))} "
          f"subjects, mean "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens, {args.in_flight} in flight, "
          f"dtype {base.config.model.dtype}, {base.runner.attention.name} attention on "
          f"{base.config.model.device}")
    rows = [mmlu_row(base, "cache on, lpm", prompts, golds, args.in_flight)]
    del base
    rows.append(mmlu_row(engine(schedule_policy="fcfs"), "cache on, fcfs", prompts, golds,
                         args.in_flight))
    rows.append(mmlu_row(engine(disable_radix_cache=True), "cache off", prompts, golds,
                         args.in_flight))
    speedup = float(rows[0][3]) / float(rows[2][3])
    print_table(["mode", "programs", "seconds", "programs/s", "accuracy", "hit rate",
                 "optimal", "hit/optimal"], rows)
    print(f"cache on (lpm) vs off: {speedup:.2f}x programs/s")
    if args.skip_no_share:
        return

    with gzip.open(os.path.join(data, "wiki_rag", "passages.jsonl.gz"), "rt") as f:
        passages = [json.loads(line)["text"] for _, line in zip(range(400), f)]
    on, off = engine(), engine(disable_radix_cache=True)
    unrelated = []
    for text in passages:
        ids = on.encode(text * 3)[:500]
        if len(ids) == 500:
            unrelated.append(ids)
    unrelated = unrelated[:32]
    params = SamplingParams(max_new_tokens=1, temperature=0)
    rates = {"on": [], "off": []}
    for _ in range(args.repeats):
        for name, eng in (("on", on), ("off", off)):
            eng.flush_cache()
            _, elapsed = run_in_flight(eng, unrelated, params, 8)
            rates[name].append(len(unrelated) / elapsed)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n(b) no shared prefix: {len(unrelated)} x 500-token prompts, 1 token, 8 in flight, "
          f"{args.repeats} alternating repeats")
    print_table(["mode", "prompts/s (median)", "all repeats"],
                [[k, f"{med[k]:.3f}", ", ".join(f"{x:.3f}" for x in rates[k])] for k in med])
    print(f"cache bookkeeping overhead: {100 * (1 - med['on'] / med['off']):+.1f}% "
          f"(positive = slower with the cache on)")


if __name__ == "__main__":
    main()
