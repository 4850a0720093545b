"""SQuAD's answer normalisation, exact match and token F1 (the official v1.1 evaluation script's
definitions), and yes/no accuracy."""

from __future__ import annotations

import collections
import re
import string


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: tuple[str, ...]) -> float:
    return float(any(normalize(prediction) == normalize(a) for a in answers))


def f1(prediction: str, answers: tuple[str, ...]) -> float:
    def one(gold: str) -> float:
        p, g = normalize(prediction).split(), normalize(gold).split()
        common = sum((collections.Counter(p) & collections.Counter(g)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(p), common / len(g)
        return 2 * precision * recall / (precision + recall)
    return max(one(a) for a in answers)


def yes_no_correct(prediction: str, answers: tuple[str, ...]) -> float:
    return float(normalize(prediction) in {normalize(a) for a in answers})
