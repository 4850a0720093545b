"""Choosing among ``select`` choices from token logprobs (pure functions, no I/O).

Each choice is scored from the logprobs of its own tokens given the prompt (SGLang's frontend,
``sglang/lang/choices.py``, has the same three methods):

* ``token_length_normalized``: mean logprob per token (the default; longer choices are not
  penalised for their length).
* ``greedy``: compare choices token by token, highest logprob first; a shorter choice is padded
  with its own mean so that a prefix of a longer choice is compared fairly.
* ``unconditional_likelihood_normalized``: mean of (logprob given the prompt - logprob without
  it), which discounts choices that are likely whatever the question (Holtzman et al. 2021,
  "Surface form competition").
"""

from __future__ import annotations

import math
import random


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else -math.inf


def normalized_scores(method: str, logprobs: list[list[float]],
                      unconditional: list[list[float]] | None = None) -> list[float]:
    """One score per choice (higher is better). ``logprobs[i]``: natural-log probabilities of
    choice i's tokens given the prompt; ``unconditional[i]``: the same without the prompt
    (needed by ``unconditional_likelihood_normalized``). Raises ValueError for a bad method."""
    if method in ("token_length_normalized", "greedy"):
        return [_mean(lp) for lp in logprobs]
    if method == "unconditional_likelihood_normalized":
        if unconditional is None:
            raise ValueError("unconditional logprobs are required")
        return [_mean(lp) - _mean(u) for lp, u in zip(logprobs, unconditional)]
    raise ValueError(f"unknown choices_method {method!r}")


def choose(method: str, logprobs: list[list[float]],
           unconditional: list[list[float]] | None = None, temperature: float = 0.0,
           rng: random.Random | None = None) -> tuple[int, list[float]]:
    """Index of the chosen choice and the per-choice normalized scores. With ``temperature`` >
    0, the choice is sampled from softmax(scores / temperature) instead of the argmax."""
    scores = normalized_scores(method, logprobs, unconditional)
    if method == "greedy":
        width = max(len(lp) for lp in logprobs)
        keys = [lp + [_mean(lp)] * (width - len(lp)) for lp in logprobs]
        best = max(range(len(keys)), key=lambda i: keys[i])
    else:
        best = max(range(len(scores)), key=lambda i: scores[i])
    if temperature > 0:
        top = max(scores)
        weights = [math.exp((s - top) / temperature) for s in scores]
        best = (rng or random).choices(range(len(scores)), weights=weights)[0]
    return best, scores


def choice_token_count(token_texts: list[str], choice: str) -> int:
    """How many trailing tokens of a ``prompt + choice`` tokenization cover ``choice``: walk back
    from the end until the tokens' text covers it. A token that straddles the prompt/choice
    boundary (the tokenizer merged them) counts as a choice token, so every character of the
    choice is scored exactly once."""
    covered, count = 0, 0
    for text in reversed(token_texts):
        if covered >= len(choice):
            break
        covered += len(text)
        count += 1
    return max(count, 1)
