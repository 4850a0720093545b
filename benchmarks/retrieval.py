"""The main job's retrievers side by side: recall@k of BM25, dense (the server's
``/v1/embeddings``), hybrid (reciprocal rank fusion) and hybrid + rerank (the server's
``/v1/rerank`` over 20 candidates), and what the server's two calls cost.

    python -m benchmarks.retrieval [--n 100] [--base-url URL]

Workload: the wiki_rag corpus (3,741 passages) and ``--n`` of its questions (half SQuAD, half
BoolQ; a question's gold passage is the one that answers it). The passages are embedded afresh
(a temporary cache), timed: passages/s and prompt tokens/s. Reranking is timed per query (20
documents each). Without ``--base-url`` it starts the bundled server on the default model.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import httpx

from benchmarks.common import print_table
from examples.rag.data import load, mixed
from examples.rag.dense import RERANK_CANDIDATES, DenseRetriever, HybridRetriever, RerankRetriever
from examples.rag.retrieval import Retriever
from kernels.cpu_features import cpu_description

KS = (1, 3, 10)


def _prompt_tokens(url: str) -> int:
    return int(httpx.get(url + "/server_info", timeout=30).json()["metrics"]["prompt_tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="questions (half span, half yes/no)")
    ap.add_argument("--base-url", default=None, help="a running bundled server")
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}")
    passages, questions = load(None)
    questions = mixed(questions, args.n)
    import sgl_adapters as sgl
    from examples.rag.__main__ import served_model

    rt = sgl.Runtime(max_total_tokens=32768) if args.base_url is None else None
    url = rt.base_url if rt is not None else args.base_url.rstrip("/")
    try:
        model = served_model(url)
        bm25 = Retriever(passages)
        before = _prompt_tokens(url)
        with tempfile.TemporaryDirectory() as tmp:
            dense = DenseRetriever(passages, url, model, cache_dir=tmp)
        embed_tokens = _prompt_tokens(url) - before
        hybrid = HybridRetriever(bm25, dense)
        rerank = RerankRetriever(hybrid, url, model)
        rows, rerank_s = [], 0.0
        for name, retriever in (("bm25", bm25), ("dense", dense), ("hybrid", hybrid),
                                ("hybrid+rerank", rerank)):
            start = time.perf_counter()  # ranked lists: the top k is a prefix of the top 10
            found = [[p.id for p in retriever.search(q.question, max(KS))] for q in questions]
            seconds = time.perf_counter() - start
            if name == "hybrid+rerank":
                rerank_s = seconds
            hits = [sum(q.gold_passage_id in f[:k] for q, f in zip(questions, found))
                    / len(questions) for k in KS]
            rows.append([name, *(f"{h:.3f}" for h in hits), f"{len(questions) / seconds:.1f}"])
    finally:
        if rt is not None:
            rt.shutdown()
    print(f"{len(passages)} passages embedded in {dense.embed_seconds:.1f} s: "
          f"{len(passages) / dense.embed_seconds:.1f} passages/s, "
          f"{embed_tokens / dense.embed_seconds:.0f} prompt tokens/s ({embed_tokens} tokens)")
    print(f"reranking {RERANK_CANDIDATES} documents per query: "
          f"{len(questions) / rerank_s:.2f} queries/s (fusion and query embedding included)")
    print_table(["retriever", *(f"recall@{k}" for k in KS), "queries/s"], rows)
    print(f"{len(questions)} questions (half SQuAD, half BoolQ), model {model}")


if __name__ == "__main__":
    main()
