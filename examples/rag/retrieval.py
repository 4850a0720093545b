"""BM25 retrieval over the passages with ``bm25s`` (Lucene-style BM25, scipy sparse scoring).
The index is built once and cached on disk, keyed by a hash of the corpus."""

from __future__ import annotations

import hashlib
import os

import bm25s

from examples.rag.data import Passage

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sgl-adapters", "bm25")


class Retriever:
    """``search(query, k)`` -> the k best passages. The index lives under ``cache_dir``."""

    def __init__(self, passages: list[Passage], cache_dir: str = CACHE_DIR):
        self.passages = passages
        digest = hashlib.sha256("\x00".join(p.id + p.text for p in passages).encode()).hexdigest()
        path = os.path.join(cache_dir, digest[:24])
        if os.path.isdir(path):
            self.index = bm25s.BM25.load(path)
            self.cached = True
        else:
            self.index = bm25s.BM25()
            self.index.index(bm25s.tokenize([self._doc(p) for p in passages], stopwords="en",
                                            show_progress=False), show_progress=False)
            os.makedirs(cache_dir, exist_ok=True)
            self.index.save(path)
            self.cached = False

    @staticmethod
    def _doc(p: Passage) -> str:
        return f"{p.title}\n{p.text}" if p.title else p.text

    def search(self, query: str, k: int = 3) -> list[Passage]:
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        ids, _ = self.index.retrieve(tokens, k=min(k, len(self.passages)), show_progress=False)
        return [self.passages[int(i)] for i in ids[0]]
