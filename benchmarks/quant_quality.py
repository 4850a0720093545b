"""Does weight quantization change answers? MMLU 5-shot accuracy (greedy, one token, the
SGLang ``benchmark/mmlu`` prompt) of the same model under several ``--quantization`` modes, in
process (no HTTP), on ../shared/data/mmlu.

    python -m benchmarks.quant_quality                      # default model: none, auto, int8, int4
    python -m benchmarks.quant_quality --per-subject 40 --modes none,auto

Prints one row per mode (accuracy, questions, seconds, weight MiB) and the agreement of each
mode's answers with the first mode's.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

from benchmarks.common import shared_data_dir
from benchmarks.prefix_cache import format_example


def load_mmlu(per_subject: int | None) -> list[tuple[str, str, str]]:
    """(5-shot head, question, gold letter) for every subject's test rows (or the first
    ``per_subject`` of each)."""
    root = shared_data_dir()
    if root is None:
        raise SystemExit("needs ../shared/data/mmlu next to the repository")
    items = []
    subjects = sorted(f[:-len("_test.csv")] for f in os.listdir(os.path.join(root, "mmlu", "test")))
    for subject in subjects:
        rows = {}
        for split in ("dev", "test"):
            with open(os.path.join(root, "mmlu", split, f"{subject}_{split}.csv"), newline="") as f:
                rows[split] = list(csv.reader(f))
        head = (f"The following are multiple choice questions (with answers) about "
                f"{subject.replace('_', ' ')}.\n\n"
                + "".join(format_example(r, True) for r in rows["dev"][:5]))
        test = rows["test"] if per_subject is None else rows["test"][:per_subject]
        items += [(head, format_example(r, False), r[5]) for r in test]
    return items


def evaluate(mode: str, items: list, dtype: str, batch: int = 64) -> tuple[list[str], dict]:
    from server.engine import Engine

    engine = Engine(quantization=mode, dtype=dtype, max_total_tokens=32768)
    params = {"max_new_tokens": 1, "temperature": 0}
    answers: list[str] = []
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        outs = engine.generate([h + q for h, q, _ in items[i:i + batch]], params)
        answers += [o["text"].strip() for o in outs]
    seconds = time.perf_counter() - start
    acc = sum(a == g for a, (_, _, g) in zip(answers, items)) / len(items)
    return answers, {"mode": mode, "accuracy": acc, "questions": len(items),
                     "seconds": round(seconds, 1),
                     "weights_mib": round(engine.runner.quant_report.weight_bytes / 2**20),
                     "weights": engine.runner.quant_report.summary()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="none,auto,int8,int4")
    p.add_argument("--per-subject", type=int, default=None, help="test rows per subject "
                   "(default: all 11,235 shared questions)")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    items = load_mmlu(args.per_subject)
    first = None
    for mode in args.modes.split(","):
        answers, row = evaluate(mode, items, args.dtype)
        if first is None:
            first = answers
        row["agree_with_first"] = round(sum(a == b for a, b in zip(answers, first)) / len(items), 4)
        print(row, flush=True)


if __name__ == "__main__":
    main()
