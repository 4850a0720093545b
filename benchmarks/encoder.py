"""BERT-family encoders served by the bundled server against sentence-transformers on the same
weights and machine: passages/s embedding the main job's corpus, and reranking throughput.

    python -m benchmarks.encoder [--n 1000] [--shape bge-base|bge-small] [--batch 32]

No real encoder weights can be downloaded here, so the models are random-weight checkpoints of
the bge-base / bge-small shapes (BERT, CLS pooling, normalized, as bge's ``modules.json``
declares; the cross-encoder a ``BertForSequenceClassification`` of the same shape, bge-reranker's
layout on a BERT body) with the default model's tokenizer (its ids fall inside the vocabulary;
token counts are close to a WordPiece tokenizer's). Outputs are noise, so only speed and the
agreement of the two implementations are measured. Rows, one process at a time on the 2 cores:
the server (``/v1/embeddings`` with the openai client, ``--batch`` texts a call; ``/v1/rerank``,
20 documents a query), then sentence-transformers' ``encode`` / ``CrossEncoder.predict`` with the
same batch size in float32 and bfloat16 (peers in their best dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from benchmarks.common import print_table
from examples.rag.data import load
from kernels.cpu_features import cpu_description

SHAPES = {"bge-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           intermediate_size=3072),
          "bge-small": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                            intermediate_size=1536)}
RERANK_DOCS = 20


def write_encoder(out: str, shape: str, arch: str) -> str:
    """A random ``arch`` checkpoint of ``shape`` with the default model's tokenizer (and, for
    an embedding model, bge's modules.json: CLS pooling, Normalize)."""
    import transformers
    from transformers import BertConfig

    from server.model.loader import default_model_path, load_model

    tok = load_model(default_model_path()).tokenizer
    cfg = BertConfig(vocab_size=len(tok), max_position_embeddings=512, num_labels=1,
                     **SHAPES[shape])
    torch.manual_seed(0)
    getattr(transformers, arch)(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    if arch == "BertModel":
        os.makedirs(os.path.join(out, "1_Pooling"))
        with open(os.path.join(out, "modules.json"), "w") as f:
            json.dump([{"idx": 0, "name": "0", "path": "", "type":
                        "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                        "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "2_Normalize", "type":
                        "sentence_transformers.models.Normalize"}], f)
        with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": cfg.hidden_size,
                       "pooling_mode_cls_token": True}, f)
    return out


def _serve(path: str, texts: list[str], queries: list[tuple[str, list[str]]], batch: int,
           rerank_path: str) -> tuple[np.ndarray, float, float, float]:
    """(vectors, passages/s, server prompt tokens, rerank queries/s) from the bundled server."""
    import httpx
    import openai

    import sgl_adapters as sgl

    with sgl.Runtime(path, max_total_tokens=65536) as rt:
        client = openai.OpenAI(base_url=rt.base_url + "/v1", api_key="x", max_retries=0)
        client.embeddings.create(model="m", input=texts[:2])  # warm-up
        info = rt.base_url + "/server_info"
        before = httpx.get(info).json()["metrics"]["prompt_tokens"]
        start = time.perf_counter()
        vecs = [d.embedding for k in range(0, len(texts), batch)
                for d in client.embeddings.create(model="m", input=texts[k:k + batch]).data]
        seconds = time.perf_counter() - start
        tokens = httpx.get(info).json()["metrics"]["prompt_tokens"] - before
    with sgl.Runtime(rerank_path, max_total_tokens=65536) as rt:
        httpx.post(rt.base_url + "/v1/rerank", json={"query": "q", "documents": ["d"]})
        start = time.perf_counter()
        for query, docs in queries:
            httpx.post(rt.base_url + "/v1/rerank", json={"query": query, "documents": docs},
                       timeout=600).raise_for_status()
        rerank = len(queries) / (time.perf_counter() - start)
    return np.array(vecs), len(texts) / seconds, tokens, rerank


def _sentence_transformers(path: str, texts: list[str], queries, batch: int, dtype: torch.dtype,
                           rerank_path: str) -> tuple[np.ndarray, float, float]:
    """(vectors, passages/s, rerank queries/s) from sentence-transformers in this process."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    model = SentenceTransformer(path, device="cpu", model_kwargs={"torch_dtype": dtype})
    model.encode(texts[:2])
    start = time.perf_counter()
    vecs = model.encode(texts, batch_size=batch)
    passages = len(texts) / (time.perf_counter() - start)
    cross = CrossEncoder(rerank_path, device="cpu", model_kwargs={"torch_dtype": dtype})
    cross.predict([("q", "d")])
    start = time.perf_counter()
    for query, docs in queries:
        cross.predict([(query, d) for d in docs], batch_size=RERANK_DOCS)
    return np.asarray(vecs, dtype=np.float32), passages, len(queries) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="passages to embed")
    ap.add_argument("--queries", type=int, default=10, help="rerank queries (20 documents each)")
    ap.add_argument("--shape", default="bge-base", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    passages, questions = load(None)
    texts = [p.text for p in passages[:args.n]]
    queries = [(q.question, [p.text for p in passages[k * RERANK_DOCS:(k + 1) * RERANK_DOCS]])
               for k, q in enumerate(questions[:args.queries])]
    with tempfile.TemporaryDirectory() as tmp:
        emb = write_encoder(os.path.join(tmp, "emb"), args.shape, "BertModel")
        rer = write_encoder(os.path.join(tmp, "rer"), args.shape, "BertForSequenceClassification")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(emb)  # the server refuses prompts over 512 tokens
        texts = [t for t in texts if len(tok(t)["input_ids"]) <= 500]
        queries = [(q, [d for d in docs if len(tok(q, d)["input_ids"]) <= 500])
                   for q, docs in queries]
        ours, ours_rate, tokens, ours_rerank = _serve(emb, texts, queries, args.batch, rer)
        rows = [["bundled server (bf16 where native, /v1/embeddings)", f"{ours_rate:.1f}",
                 f"{tokens / (len(texts) / ours_rate):.0f}", f"{ours_rerank:.2f}", "-"]]
        for dtype in (torch.float32, torch.bfloat16):
            vecs, rate, rerank = _sentence_transformers(emb, texts, queries, args.batch, dtype,
                                                        rer)
            cosine = float(np.mean(np.sum(vecs * ours, axis=1)))
            rows.append([f"sentence-transformers {str(dtype)[6:]}", f"{rate:.1f}",
                         f"{tokens / (len(texts) / rate):.0f}", f"{rerank:.2f}",
                         f"{cosine:.4f}"])
    print(f"{args.shape} shape, {len(texts)} wiki_rag passages ({tokens} tokens), batch "
          f"{args.batch}; rerank {len(queries)} queries x {RERANK_DOCS} documents")
    print_table(["implementation", "passages/s", "tokens/s", "rerank queries/s",
                 "mean cosine vs ours"], rows)


if __name__ == "__main__":
    main()
