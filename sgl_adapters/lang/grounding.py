"""Grounded extraction: the grammar of every contiguous word span of some texts, so a
generated answer is always copied from them (``sgl.gen(..., substring_of=passages)``).

A span starts and ends on a word (a run of ``\\w`` characters) and keeps the text's own
separators between its words (spaces, punctuation, newlines), so "Guglielmo Marconi" and
"1895" can come out of "... Guglielmo Marconi sent signals in 1895." but "Marconi sent" with a
changed separator, or a word that is not there, cannot. The grammar is linear in the text:
one rule per word, ``w_i ::= "word_i" ("sep_i" w_{i+1})?``, and ``root`` is the alternation of
the rules, i.e. "start at any word, stop after any later word". Given several texts, a span
never crosses from one into the next.

With ``max_words`` L a span has at most L words: one rule per (word, words left), so the
grammar grows as n x L instead of n (small models otherwise run on through a sentence).

The result is an EBNF grammar in xgrammar's dialect (the server's ``ebnf`` constraint); string
literals are JSON-escaped.
"""

from __future__ import annotations

import json
import re
from typing import Collection, Sequence

_WORD = re.compile(r"(\w+)")


def substring_grammar(texts: str | Sequence[str], max_words: int | None = None,
                      edge_stopwords: Collection[str] = ()) -> str:
    """EBNF (``root ::= ...``) accepting exactly the word spans of ``texts``.

    Args:
        texts: one text or several (passages); spans stay within one.
        max_words: longest span in words (None = no limit).
        edge_stopwords: words (compared lowercased) a span may not start or end with, e.g.
            articles and prepositions, so an extracted answer is a content phrase ("Tate
            Britain", not "The museum of").
    Raises ValueError when no span is possible, or max_words < 1.
    """
    if max_words is not None and max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    stop = {w.lower() for w in edge_stopwords}
    limit = max_words or 1 << 30
    texts = [texts] if isinstance(texts, str) else list(texts)
    starts: list[str] = []
    rules: list[str] = []
    for t, text in enumerate(texts):
        parts = _WORD.split(text)
        words, seps = parts[1::2], parts[2::2]
        n = len(words)
        edge = [w.lower() not in stop for w in words]
        # ends[i]: how far (in words, counting word i) the nearest allowed span end is
        ends, nearest = [0] * n, 0
        for i in range(n - 1, -1, -1):
            nearest = 1 if edge[i] else (nearest + 1 if nearest else 0)
            ends[i] = nearest
        for i, word in enumerate(words):
            lefts = [None] if max_words is None else range(1, min(max_words, n - i) + 1)
            for left in lefts:
                if not ends[i] or ends[i] > (left or limit):
                    continue  # no allowed end within reach: the rule would be a dead end
                name = f"t{t}w{i}" + ("" if left is None else f"r{left}")
                body = _lit(word)
                go_on = i + 1 < n and left != 1 and ends[i + 1] and \
                    ends[i + 1] <= (limit if left is None else left - 1)
                if go_on:
                    nxt = f"t{t}w{i + 1}" + ("" if left is None else f"r{left - 1}")
                    more = f"{_lit(seps[i])} {nxt}"
                    body += f" ({more})?" if edge[i] else f" {more}"
                rules.append(f"{name} ::= {body}")
            top = None if max_words is None else min(max_words, n - i)
            if edge[i] and ends[i] <= (top or limit):
                starts.append(f"t{t}w{i}" + ("" if top is None else f"r{top}"))
    if not starts:
        raise ValueError("substring_of: the text has no words to copy from")
    return "\n".join([f"root ::= {' | '.join(starts)}", *rules])


def _lit(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)
