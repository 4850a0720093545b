"""``python -m examples.rag``: retrieval-augmented QA over Wikipedia passages through the
bundled server (``make run`` runs this with defaults).

    python -m examples.rag [--pipeline sgl|dspy|langchain] [--n 100] [--k 3] [--base-url URL]
                           [--data-dir DIR] [--out rag_results.jsonl]

Without ``--base-url`` it starts the bundled server on the default model. Prints a few answers
and a summary: exact match / F1 on span questions (SQuAD), accuracy on yes/no questions (BoolQ),
retrieval recall@k, questions per second and the server's cache hit rate; writes one JSON line
per question to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from examples.rag import metrics
from examples.rag.data import load, mixed
from examples.rag.pipelines import PIPELINES
from examples.rag.retrieval import Retriever


def _cache_counters(base_url: str) -> tuple[int, int]:
    m = httpx.get(base_url + "/server_info", timeout=30).json()["metrics"]
    return m["prompt_tokens"], m["cached_prompt_tokens"]


def evaluate(pipeline: str, questions, retriever: Retriever, k: int, base_url: str,
             progress: bool = False) -> dict:
    """Run one pipeline; per-question rows and the summary."""
    before = _cache_counters(base_url)
    start = time.perf_counter()
    answers = PIPELINES[pipeline](questions, retriever, k, base_url, progress=progress)
    seconds = time.perf_counter() - start
    after = _cache_counters(base_url)
    rows = []
    for q, a in zip(questions, answers):
        row = {"id": q.id, "question": q.question, "answer_type": q.answer_type,
               "gold": list(q.answers), "prediction": a,
               "retrieved_gold": q.gold_passage_id in {p.id for p in retriever.search(q.question,
                                                                                        k)}}
        if q.answer_type == "span":
            row.update(em=metrics.exact_match(a, q.answers), f1=metrics.f1(a, q.answers))
        else:
            row["correct"] = metrics.yes_no_correct(a, q.answers)
        rows.append(row)
    spans = [r for r in rows if r["answer_type"] == "span"]
    yes_no = [r for r in rows if r["answer_type"] == "yes_no"]
    prompt, cached = after[0] - before[0], after[1] - before[1]
    summary = {
        "pipeline": pipeline, "questions": len(rows), "seconds": round(seconds, 1),
        "questions_per_s": round(len(rows) / seconds, 2),
        "span_em": round(statistics.mean(r["em"] for r in spans), 3) if spans else None,
        "span_f1": round(statistics.mean(r["f1"] for r in spans), 3) if spans else None,
        "yes_no_accuracy": (round(statistics.mean(r["correct"] for r in yes_no), 3)
                            if yes_no else None),
        "retrieval_recall": round(statistics.mean(r["retrieved_gold"] for r in rows), 3),
        "cache_hit_rate": round(cached / prompt, 3) if prompt else None,
    }
    return {"rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", choices=sorted(PIPELINES), default="sgl")
    ap.add_argument("--n", type=int, default=100, help="questions (half span, half yes/no)")
    ap.add_argument("--k", type=int, default=3, help="passages retrieved per question")
    ap.add_argument("--base-url", default=None, help="a running bundled server (default: start "
                    "one on the default model)")
    ap.add_argument("--data-dir", default=None, help="directory with the wiki_rag files "
                    "(default ../shared/data/wiki_rag)")
    ap.add_argument("--out", default="rag_results.jsonl")
    args = ap.parse_args(argv)

    passages, questions = load(args.data_dir)
    print(f"{len(passages)} passages, {len(questions)} questions; building the BM25 index ...")
    retriever = Retriever(passages)
    questions = mixed(questions, args.n)
    runtime = None
    if args.base_url is None:
        import sgl_adapters as sgl

        print("starting the bundled server on the default model ...")
        runtime = sgl.Runtime(max_total_tokens=32768)
        base_url = runtime.base_url
    else:
        base_url = args.base_url.rstrip("/")
    try:
        print(f"running the {args.pipeline} pipeline on {len(questions)} questions (k={args.k}) ...")
        result = evaluate(args.pipeline, questions, retriever, args.k, base_url, progress=True)
    finally:
        if runtime is not None:
            runtime.shutdown()
    for row in result["rows"][:4]:
        print(f"- Q: {row['question']}\n  predicted: {row['prediction']!r}  gold: {row['gold'][:3]}")
    with open(args.out, "w") as f:
        for row in result["rows"]:
            f.write(json.dumps(row) + "\n")
    print("summary:", json.dumps(result["summary"]))
    print(f"per-question results: {args.out}")


if __name__ == "__main__":
    main()
